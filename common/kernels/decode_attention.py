"""Decode attention over the paged KV cache as two Triton kernels (split-K, then the splits' merge).

One query per sequence (a decode step). Program (sequence t, query head h, split s) walks its share of the
keys — every cached position (dense), or the positions a sparse selection lists (QSA: the indexer's chosen
blocks plus the query's own incomplete block), −1 entries skipped — reads each key and value through the
page table (fp8 pages dequantised with the layer's scales), and keeps an online softmax (running max, sum,
weighted values) in fp32. The second kernel merges the splits. Splitting the keys keeps the GPU busy when
one sequence has few heads (flash-decoding); the launch shape depends only on the bound on keys.

Agrees with the torch reference (common/kv/backend.py) to rounding: the reference forms scores and the
value product in the activation dtype, this in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, sel_ptr, ks_ptr, vs_ptr, m_ptr, l_ptr, acc_ptr,
    heads, kv_heads, table_width, page_size, keys, sel_width, scale, window,
    D: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, ITERS: tl.constexpr, SPARSE: tl.constexpr,
    FP8: tl.constexpr, WINDOW: tl.constexpr,
):  # fmt: skip
    t, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kvh = h // (heads // kv_heads)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (t * heads + h) * D + d).to(tl.float32) * scale
    length = tl.load(lens_ptr + t)  # keys of this sequence, the query's own included
    first = s * ITERS * BLOCK_N  # this split's keys: [first, first + ITERS·BLOCK_N) ∩ [0, keys)
    m = tl.full((), -1e30, tl.float32)
    denom = tl.zeros((), dtype=tl.float32)
    acc = tl.zeros((D,), dtype=tl.float32)
    if FP8:
        k_scale, v_scale = tl.load(ks_ptr).to(tl.float32), tl.load(vs_ptr).to(tl.float32)
    for i in range(ITERS):
        idx = first + i * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = idx < keys
        if SPARSE:  # noqa: SIM108  (a static branch)
            pos = tl.load(sel_ptr + t * sel_width + idx, mask=inside, other=-1)
        else:
            pos = idx
        ok = inside & (pos >= 0) & (pos < length)
        if WINDOW:
            ok = ok & (pos > length - 1 - window)
        safe = tl.where(ok, pos, 0)
        page = tl.load(table_ptr + t * table_width + safe // page_size, mask=ok, other=0).to(tl.int64)
        row = (page * page_size + safe % page_size) * kv_heads + kvh  # [BLOCK_N] token rows of this head
        k = tl.load(k_ptr + row[:, None] * D + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + row[:, None] * D + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        if FP8:
            k, v = k * k_scale, v * v_scale
        score = tl.where(ok, tl.sum(k * q[None, :], axis=1), float("-inf"))
        new_m = tl.maximum(m, tl.max(score, axis=0))
        p = tl.exp(score - new_m)
        correction = tl.exp(m - new_m)
        denom = denom * correction + tl.sum(p, axis=0)
        acc = acc * correction + tl.sum(p[:, None] * v, axis=0)
        m = new_m
    at = (t * heads + h) * SPLITS + s
    tl.store(m_ptr + at, m)
    tl.store(l_ptr + at, denom)
    tl.store(acc_ptr + at * D + d, acc)


@triton.jit
def _merge_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, D: tl.constexpr, SPLITS: tl.constexpr):
    row = tl.program_id(0)  # (token, head)
    s = tl.arange(0, SPLITS)
    m = tl.load(m_ptr + row * SPLITS + s)
    weight = tl.exp(m - tl.max(m, axis=0))  # [SPLITS]
    denom = tl.sum(tl.load(l_ptr + row * SPLITS + s) * weight, axis=0)
    d = tl.arange(0, D)
    acc = tl.load(acc_ptr + (row * SPLITS + s)[:, None] * D + d[None, :])  # [SPLITS, D]
    out = tl.sum(acc * weight[:, None], axis=0) / denom
    tl.store(out_ptr + row * D + d, out.to(out_ptr.dtype.element_ty))


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
    splits: int = 16,
    block_n: int = 32,
) -> torch.Tensor:
    """q [T, Hq, D] (one query per sequence, at position kv_lens[t] − 1); k/v pages [P, page, Hkv, D];
    page_table [T, W]; kv_lens [T] int64 → attention [T, Hq, D] in q's dtype. `max_keys` bounds kv_lens
    (fixes the launch shape); `selected` [T, S] key positions a query may see (−1: none) replaces "every
    earlier key"; `kv_scale` [2] (fp8 pages: K and V scales); `window`: keys within the last `window`."""
    t, heads, dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    keys = selected.shape[1] if selected is not None else max_keys
    bound = triton.next_power_of_2(keys)  # compiled per power of two of the key bound, not per length
    splits = min(triton.next_power_of_2(splits), max(1, bound // block_n))
    iters = triton.cdiv(bound, splits * block_n)
    m = torch.empty((t, heads, splits), dtype=torch.float32, device=q.device)
    denom = torch.empty_like(m)
    acc = torch.empty((t, heads, splits, dim), dtype=torch.float32, device=q.device)
    fp8 = kv_scale is not None
    scales = kv_scale if fp8 else m  # unread without fp8
    sel = selected.contiguous() if selected is not None else page_table
    _split_kernel[(t, heads, splits)](
        q.contiguous(), k_pages, v_pages, page_table, kv_lens, sel, scales, scales[1:] if fp8 else m,
        m, denom, acc, heads, kv_heads, page_table.shape[1], page_size, keys, sel.shape[1], scale,
        window or 0,
        D=dim, BLOCK_N=block_n, SPLITS=splits, ITERS=iters, SPARSE=selected is not None, FP8=fp8,
        WINDOW=window is not None,
    )  # fmt: skip
    out = torch.empty_like(q)
    _merge_kernel[(t * heads,)](m, denom, acc, out, D=dim, SPLITS=splits)
    return out
