"""Decode attention over the paged KV cache as two Triton kernels: split-K, then the splits' merge.

One program handles (query t, KV head, split s) and all query heads of that KV head's group: each key and
value row is read once a group, and the group's queries form a [G_PAD, D] tile (G padded to a power of two
≥ 16, the padding rows zeros, never stored), so scores and the value product are tensor-core dots. A program
walks its share of the keys (every cached position, or a sparse selection's positions, −1 skipped) through
the page table (fp8 pages dequantised with the layer's K and V scales) with an online softmax in fp32; the
merge kernel combines the splits. The launch shape depends only on the key bound and the tensors' shapes: no
host sync, safe inside CUDA graphs. Agrees with the torch reference (common/kv/backend.py) to rounding: the
dots take q's dtype, the probabilities are rounded to it before the value product, the softmax stays fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.kernels.config import KERNELS, KernelConfig
from common.kernels.pdl import gdc_enter, launch


@triton.jit
def _key_block(
    q, k_ptr, v_ptr, table_ptr, sel_ptr, t, kvh, table_row, table_width, page_size, kv_heads, sel_width,
    start, limit, length, scale, window, m, denom, acc,
    D: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE: tl.constexpr, WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Keys [start, start + BLOCK_N) of the program's share into its online softmax → (m, denom, acc)."""
    d = tl.arange(0, D)
    idx = start + tl.arange(0, BLOCK_N)
    inside = idx < limit
    if SPARSE:  # noqa: SIM108  (a static branch)
        pos = tl.load(sel_ptr + t * sel_width + idx, mask=inside, other=-1)
    else:
        pos = idx
    ok = inside & (pos >= 0) & (pos < length)
    if WINDOW:
        ok = ok & (pos > length - 1 - window)
    safe = tl.where(ok, pos, 0)
    page = tl.load(table_ptr + table_row * table_width + safe // page_size, mask=ok, other=0)
    page = page.to(tl.int64)
    row = (page * page_size + safe % page_size) * kv_heads + kvh  # [BLOCK_N] token rows of this head
    k = tl.load(k_ptr + row[:, None] * D + d[None, :], mask=ok[:, None], other=0.0).to(q.dtype)
    v = tl.load(v_ptr + row[:, None] * D + d[None, :], mask=ok[:, None], other=0.0).to(q.dtype)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    score = tl.where(ok[None, :], qk * scale, float("-inf"))  # [G_PAD, BLOCK_N]
    new_m = tl.maximum(m, tl.max(score, axis=1))
    p = tl.exp(score - new_m[:, None])
    correction = tl.exp(m - new_m)
    denom = denom * correction + tl.sum(p, axis=1)
    # the probabilities in the activation dtype, as the reference rounds them
    acc = acc * correction[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
    return new_m, denom, acc


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, rows_ptr, lens_ptr, sel_ptr, ks_ptr, vs_ptr, m_ptr, l_ptr, acc_ptr,
    out_ptr, heads, kv_heads, table_width, page_size, keys, sel_width, scale, window,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
    ITERS: tl.constexpr, SPARSE: tl.constexpr, FP8: tl.constexpr, WINDOW: tl.constexpr,
    PRECISION: tl.constexpr, ROWS: tl.constexpr, TRIP: tl.constexpr, STAGES: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(GDC)
    t, kvh, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    table_row = t.to(tl.int64)  # the query's sequence: its own row, or (prefill) the one rows_ptr names
    if ROWS:
        table_row = tl.load(rows_ptr + t).to(tl.int64)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    head = kvh * GROUP + g  # [G_PAD] the query heads of this KV head's group; rows ≥ GROUP are padding
    real = g < GROUP
    q = tl.load(q_ptr + (t * heads + head)[:, None] * D + d[None, :], mask=real[:, None], other=0.0)
    if FP8:  # K's scale scales the scores; V's, being linear, the accumulator once at the end
        scale = scale * tl.load(ks_ptr).to(tl.float32)
    length = tl.load(lens_ptr + t)  # keys of this sequence, the query's own included
    # Keys this program's blocks may hold: a selection's width, or (dense) the cached ones; blocks past it
    # are skipped whole (a runtime branch, so neither the launch shape nor the compiled code depends on it).
    limit = keys if SPARSE else tl.minimum(length, keys)
    first = s * ITERS * BLOCK_N  # this split's keys: [first, first + ITERS·BLOCK_N) ∩ [0, limit)
    m = tl.full((G_PAD,), -1e30, tl.float32)  # finite, so a row with no key yet gives exp(−inf − m) = 0
    denom = tl.zeros((G_PAD,), dtype=tl.float32)
    acc = tl.zeros((G_PAD, D), dtype=tl.float32)
    if TRIP:  # ITERS blocks, no branch (those past the limit load nothing): a loop Triton can pipeline
        for i in tl.range(0, ITERS, num_stages=STAGES):
            m, denom, acc = _key_block(
                q, k_ptr, v_ptr, table_ptr, sel_ptr, t, kvh, table_row, table_width, page_size, kv_heads,
                sel_width, first + i * BLOCK_N, limit, length, scale, window, m, denom, acc,
                D, BLOCK_N, SPARSE, WINDOW, PRECISION,
            )  # fmt: skip
    else:  # every block of the bound, those past the limit skipped whole (a runtime branch)
        for i in range(ITERS):
            if first + i * BLOCK_N < limit:
                m, denom, acc = _key_block(
                    q, k_ptr, v_ptr, table_ptr, sel_ptr, t, kvh, table_row, table_width, page_size, kv_heads,
                    sel_width, first + i * BLOCK_N, limit, length, scale, window, m, denom, acc,
                    D, BLOCK_N, SPARSE, WINDOW, PRECISION,
                )  # fmt: skip
    if FP8:
        acc = acc * tl.load(vs_ptr).to(tl.float32)
    if SPLITS == 1:  # the only split: the output itself, no partial results to merge
        out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        rows = (t * heads + head)[:, None] * D + d[None, :]
        tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=real[:, None])
    else:
        at = (t * heads + head) * SPLITS + s  # [G_PAD] (token, query head, split) rows of the partials
        tl.store(m_ptr + at, m, mask=real)
        # A split that saw no key (past a sequence's end or a selection's width) leaves its sum and values
        # unwritten: the merge reads them only where m says the split saw one.
        seen = real & (m > -1e30)
        tl.store(l_ptr + at, denom, mask=seen)
        tl.store(acc_ptr + at[:, None] * D + d[None, :], acc, mask=seen[:, None])


@triton.jit
def _merge_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, gate_ptr, heads, gate_stride_t, gate_stride_h,
    D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_D: tl.constexpr, GATE: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(GDC)
    row, part = tl.program_id(0), tl.program_id(1)  # (token, query head), a BLOCK_D slice of the head dim
    s = tl.arange(0, SPLITS)
    m = tl.load(m_ptr + row * SPLITS + s)
    seen = m > -1e30  # splits that saw a key; the others wrote no sum or values
    weight = tl.where(seen, tl.exp(m - tl.max(m, axis=0)), 0.0)  # [SPLITS]
    denom = tl.sum(tl.load(l_ptr + row * SPLITS + s, mask=seen, other=0.0) * weight, axis=0)
    d = part * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.load(acc_ptr + (row * SPLITS + s)[:, None] * D + d[None, :], mask=seen[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(denom > 0, denom, 1.0)  # no key seen: 0
    out = out.to(out_ptr.dtype.element_ty)
    if GATE:  # out · σ(gate), each rounded to the output's dtype first, as the same ops in torch round
        at = (row // heads) * gate_stride_t + (row % heads) * gate_stride_h + d
        gate = tl.load(gate_ptr + at).to(tl.float32)
        gate = (1.0 / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)
        out = (out.to(tl.float32) * gate.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * D + d, out)


MERGE_BLOCK_D = 64
"""Head-dim slice of one merge program: a few programs per head, so the merge's reads of SPLITS partial
results spread over the GPU instead of queueing behind one program per head."""


def _num_splits(tokens: int, kv_heads: int, bound: int, block_n: int, cap: int | None, programs: int) -> int:
    """Splits of the keys (a power of two): enough for `programs` programs (KernelConfig.attention_programs),
    at most one block each, at most `cap`; from the shapes alone. A program waits on one chain of dependent
    loads a block of keys, so the bytes in flight grow with the programs resident at once."""
    want = triton.next_power_of_2(triton.cdiv(programs, tokens * kv_heads))
    if cap is not None:
        want = min(want, triton.next_power_of_2(cap))
    return max(1, min(want, bound // block_n))


def paged_decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    max_keys: int,
    selected: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
    window: int | None = None,
    splits: int | None = None,
    block_n: int = 32,
    table_rows: torch.Tensor | None = None,
    pipelined: bool | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    gate: torch.Tensor | None = None,
    kernels: KernelConfig = KERNELS,
) -> torch.Tensor:
    """q [T, Hq, D] (query t at position kv_lens[t] − 1); k/v pages [P, page, Hkv, D]; page_table [B, W],
    query t's row table_rows[t] (default t); kv_lens [T] int64 → [T, Hq, D] in q's dtype. `max_keys` bounds
    kv_lens (fixes the launch shape); `selected` [T, S] visible key positions (−1: none); `kv_scale` [2]
    (fp8 K and V scales); `window`: the last `window` keys only. `splits` caps the key splits; `block_n` keys
    a step. Prefill queries are rows too (`table_rows`): one split each, no merge.
    `pipelined`: each program runs the fixed count of `keys`' blocks, a branchless loop Triton pipelines in
    `num_stages` (default: for sparse passes, whose selection is as wide as its keys); else the bound's
    blocks, skipping those past the limit. `gate` [T, Hq, D] (last dim contiguous): output · σ(gate), applied
    by the merge (one split: by torch)."""
    t, heads, dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    assert dim >= 16 and dim & (dim - 1) == 0, f"head dim {dim}: a power of two ≥ 16 (tl.dot)"
    assert block_n >= 16 and block_n & (block_n - 1) == 0, f"block_n {block_n}: a power of two ≥ 16"
    assert heads % kv_heads == 0, f"{heads} query heads over {kv_heads} KV heads"
    group = heads // kv_heads
    keys = selected.shape[1] if selected is not None else max_keys
    pipelined = selected is not None if pipelined is None else pipelined
    bound = max(triton.next_power_of_2(keys), block_n)  # compiled per power of two of the key bound
    splits = _num_splits(t, kv_heads, bound, block_n, splits, kernels.attention_programs)
    # the pipelined loop runs every block it is given, so it gets the keys' blocks, not the bound's
    iters = triton.cdiv(keys if pipelined else bound, splits * block_n)
    out = torch.empty_like(q)
    partial = (t, heads, splits) if splits > 1 else (1, 1, 1)  # one split writes `out` directly
    m = torch.empty(partial, dtype=torch.float32, device=q.device)
    denom = torch.empty_like(m)
    acc = torch.empty((*partial, dim), dtype=torch.float32, device=q.device)
    fp8 = kv_scale is not None
    scales = kv_scale if kv_scale is not None else m  # unread without fp8
    sel = selected.contiguous() if selected is not None else page_table
    # Dots take q's dtype (bf16 on the GPU; fp8 pages widen to it exactly); fp32 ones in full IEEE fp32, as
    # tf32 (the default, which 16-bit inputs ignore) would miss the fp32 reference by ~1e-3.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    rows = table_rows if table_rows is not None else kv_lens  # unread without table_rows
    # trigger_first (KernelConfig.pdl_start_trigger): the next kernels, the merge and the output
    # projection, read only weights before their wait
    _split_kernel[(t, kv_heads, splits)](
        q.contiguous(), k_pages, v_pages, page_table, rows, kv_lens, sel, scales, scales[1:] if fp8 else m,
        m, denom, acc, out, heads, kv_heads, page_table.shape[1], page_size, keys, sel.shape[1], scale,
        window or 0,
        GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), D=dim, BLOCK_N=block_n, SPLITS=splits,
        ITERS=iters, SPARSE=selected is not None, FP8=fp8, WINDOW=window is not None,
        PRECISION=precision, ROWS=table_rows is not None, TRIP=pipelined, STAGES=num_stages,
        num_warps=num_warps, **launch(q.device, trigger_first=True, kernels=kernels),
    )  # fmt: skip
    if splits == 1:
        return out if gate is None else out * torch.sigmoid(gate)
    block_d = min(dim, MERGE_BLOCK_D)
    if gate is not None:
        assert gate.shape == q.shape and gate.stride(2) == 1, "gate: [T, Hq, D], its last dim contiguous"
    gates = gate if gate is not None else out  # unread without a gate
    _merge_kernel[(t * heads, dim // block_d)](
        m, denom, acc, out, gates, heads, gates.stride(0), gates.stride(1),
        D=dim, SPLITS=splits, BLOCK_D=block_d, GATE=gate is not None,
        **launch(q.device, trigger_first=True, kernels=kernels),
    )  # fmt: skip
    return out
