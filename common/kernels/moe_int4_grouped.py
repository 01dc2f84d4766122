"""Prefill MoE over int4 (W4A16, group 128) experts in their pool rows: (token, choice) pairs grouped by
expert into blocks, each block's products tiled GEMMs on tensor cores (two Triton kernels).

`group_pairs` sorts the pairs by expert without a host sync; gate/up runs over every block (SiLU · up fused,
act [P, I]), then down over the pairs of at most MOE_DOWN_TOKENS tokens at a time, its rows weighted by the
routing weights and a token's k rows summed. The int4 layout and `expert_ptrs` are the decode kernels'
(moe_int4.py); here each group of codes is dequantised in the activations' dtype, its nibbles interleaved back
into input order, and multiplied by `tl.dot`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from common.kernels.config import MOE_DOWN_TOKENS
from common.kernels.moe_int4 import GROUP, expert_ptrs


@triton.jit
def _load_a(a_ptr, a_rows, a_live, a_width, g, GROUP_: tl.constexpr):
    """Rows `a_rows` of a, input group g: [BM, GROUP_] (0 in dead rows), each row one contiguous read."""
    at = a_rows[:, None] * a_width + g * GROUP_ + tl.arange(0, GROUP_)[None, :]
    return tl.load(a_ptr + at, mask=a_live[:, None], other=0.0)


@triton.jit
def _tile_dot(acc, a, w_ptr, s_ptr, z_ptr, w_rows, g, in_half, groups, HALF: tl.constexpr):
    """acc [BM, BN] += a [BM, 2·HALF] (input group g) · w[w_rows, group g]ᵀ, w int4 dequantised in a's dtype
    in registers; the low and high nibbles interleaved back into input order so one K = 128 product runs
    on contiguous activations."""
    j = tl.arange(0, HALF)
    packed = tl.load(w_ptr + w_rows[:, None] * in_half + g * HALF + j[None, :])  # [BN, HALF] uint8
    scale = tl.load(s_ptr + w_rows * groups + g)[:, None].to(a.dtype)
    zero = tl.load(z_ptr + w_rows * groups + g)[:, None].to(a.dtype)
    codes = tl.interleave(packed & 15, packed >> 4).to(a.dtype)  # [BN, 2·HALF]: input 2j low, 2j+1 high
    w = (codes - zero) * scale  # (q − z) is exact in bf16: one rounding, as dequantising in fp32 would
    return tl.dot(a, tl.trans(w), acc)


@triton.jit
def _block(rows_ptr, pairs_ptr, expert, b, BM: tl.constexpr):
    """Block b's expert row in the pool and its (token, choice) pairs ([BM], −1: padding, and the mask)."""
    row = tl.load(rows_ptr + expert).to(tl.int64)
    pairs = tl.load(pairs_ptr + b * BM + tl.arange(0, BM))
    return row, pairs, pairs >= 0


@triton.jit
def _grouped_gate_up_kernel(
    x_ptr, pairs_ptr, block_expert_ptr, rows_ptr, w_ptr, s_ptr, z_ptr, act_ptr, k, hidden, inter,
    GROUPS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, HALF: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    expert = tl.load(block_expert_ptr + b)
    if expert < 0:
        return
    row, pairs, live = _block(rows_ptr, pairs_ptr, expert, b, BM)
    tokens = tl.where(live, pairs // k, 0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN] act columns
    w, s, z = expert_ptrs(w_ptr, s_ptr, z_ptr, row, 2 * inter, GROUPS, HALF)
    gate = tl.zeros((BM, BN), dtype=tl.float32)
    up = tl.zeros((BM, BN), dtype=tl.float32)
    for g in tl.range(GROUPS, num_stages=STAGES):
        a = _load_a(x_ptr, tokens, live, hidden, g, 2 * HALF)  # gathered once for gate and up
        gate = _tile_dot(gate, a, w, s, z, n, g, GROUPS * HALF, GROUPS, HALF)
        up = _tile_dot(up, a, w, s, z, n + inter, g, GROUPS * HALF, GROUPS, HALF)
    act = gate / (1.0 + tl.exp(-gate)) * up
    at = tl.where(live, pairs, 0)[:, None] * inter + n[None, :]
    tl.store(act_ptr + at, act.to(act_ptr.dtype.element_ty), mask=live[:, None])


@triton.jit
def _grouped_down_kernel(
    act_ptr, pairs_ptr, block_expert_ptr, rows_ptr, weights_ptr, w_ptr, s_ptr, z_ptr, out_ptr, hidden, inter,
    GROUPS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, HALF: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    expert = tl.load(block_expert_ptr + b)
    if expert < 0:
        return
    row, pairs, live = _block(rows_ptr, pairs_ptr, expert, b, BM)
    safe = tl.where(live, pairs, 0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN] output columns
    w, s, z = expert_ptrs(w_ptr, s_ptr, z_ptr, row, hidden, GROUPS, HALF)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for g in tl.range(GROUPS, num_stages=STAGES):
        a = _load_a(act_ptr, safe, live, inter, g, 2 * HALF)
        acc = _tile_dot(acc, a, w, s, z, n, g, GROUPS * HALF, GROUPS, HALF)
    acc = acc * tl.load(weights_ptr + safe, mask=live, other=0.0).to(tl.float32)[:, None]
    tl.store(
        out_ptr + safe[:, None] * hidden + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=live[:, None]
    )


def group_pairs(topk_ids: torch.Tensor, num_experts: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of `block` (token, choice) pairs that use one expert each, without a host sync: (pairs
    [blocks·block] pair indices, −1 in each expert's padding; block_expert [blocks], −1 for unused blocks),
    blocks = min(ceil(P / block) + E, P), the worst case (every expert adds at most one partial block, and
    has at most as many blocks as pairs). (Counts by `index_add_`: CUDA's `bincount` reads the ids' maximum
    back to the host.)"""
    flat = topk_ids.reshape(-1)
    p, device = flat.numel(), flat.device
    order = torch.argsort(flat, stable=True)  # pairs by expert
    ones = torch.ones_like(flat)
    counts = torch.zeros(num_experts, dtype=flat.dtype, device=device).index_add_(0, flat, ones)  # [E]
    padded = (counts + block - 1) // block * block
    ends = torch.cumsum(padded, 0)  # [E] end of each expert's padded range
    expert = flat[order]
    rank = torch.arange(p, device=device) - (torch.cumsum(counts, 0) - counts)[expert]  # within its expert
    position = (ends - padded)[expert] + rank
    blocks = min(-(-p // block) + num_experts, p)  # an expert's blocks are at most its pairs (decode: P)
    pairs = torch.full((blocks * block,), -1, dtype=torch.int64, device=device)
    pairs[position] = order
    starts = torch.arange(blocks, device=device) * block
    block_expert = torch.searchsorted(ends, starts, right=True)  # the expert whose range holds the block
    block_expert = torch.where(starts < ends[-1], block_expert, -1)
    return pairs, block_expert


def down_slices(
    topk_ids: torch.Tensor, num_experts: int, block: int, down_tokens: int, whole: tuple[torch.Tensor, ...]
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """(start, end, pairs, block_expert) of each slice of at most `down_tokens` tokens (`group_pairs` of its
    pairs; `whole`, that of every token, for a single slice), the slices of equal size: a short last slice
    would spread few pairs over every expert, its blocks mostly padding, at nearly a full slice's cost."""
    t = topk_ids.shape[0]
    size = triton.cdiv(t, triton.cdiv(t, down_tokens))
    for start in range(0, t, size):
        end = min(t, start + size)
        grouped = whole if (start, end) == (0, t) else group_pairs(topk_ids[start:end], num_experts, block)
        yield start, end, grouped[0], grouped[1]


@dataclass(frozen=True)
class GroupedConfig:
    """Launch shape of the grouped prefill kernels."""

    block_m: int = 128
    """(token, choice) pairs per block (each block one expert's; its last block padded)."""
    block_n: int = 128
    """Output columns per program."""
    num_warps: int = 8
    stages: int = 3
    """Software-pipelining stages of the loop over input groups (1: none)."""


GROUPED = GroupedConfig()
"""The default launch shape: the fastest of `python -m bench.moe_int4_tune --grouped` at prefill's large
batches (layer-major groups)."""


def moe_int4_grouped(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    rows: torch.Tensor,
    pool: dict[str, torch.Tensor],
    config: GroupedConfig = GROUPED,
    down_tokens: int = MOE_DOWN_TOKENS,
) -> torch.Tensor:
    """Prefill: Σ_j topk_weights[t, j] · SwiGLU expert topk_ids[t, j] (x[t]) → [T, H] in x's dtype, with
    expert e's int4 weights at pool row rows[e] ([E] int64). Pairs grouped by expert into blocks of
    `config.block_m`; gate/up runs over every pair as tiled GEMMs, then down over the pairs of at most
    `down_tokens` tokens at a time, in slices of equal size (its output rows are the big buffer). Each
    pair's term is rounded to x's dtype and the k terms of a token are summed in fp32 (in choice order)."""
    t, k = topk_ids.shape
    hidden = x.shape[1]
    inter = pool["down_qweight"].shape[2] * 2
    bm, bn = config.block_m, config.block_n
    assert inter % bn == 0 and hidden % bn == 0, f"block_n {bn} must divide {inter} and {hidden}"
    pairs, block_expert = group_pairs(topk_ids, rows.numel(), bm)
    x = x.contiguous()
    launch = {"num_warps": config.num_warps, "STAGES": config.stages, "BM": bm, "BN": bn, "HALF": GROUP // 2}
    act = torch.empty((t * k, inter), dtype=x.dtype, device=x.device)
    _grouped_gate_up_kernel[(block_expert.numel(), inter // bn)](
        x, pairs, block_expert, rows, pool["gate_up_qweight"], pool["gate_up_scales"], pool["gate_up_zeros"],
        act, k, hidden, inter, GROUPS=hidden // GROUP, **launch,
    )  # fmt: skip
    weights = topk_weights.reshape(-1).contiguous()
    out = torch.empty((t, hidden), dtype=x.dtype, device=x.device)
    # bounded [n·k, H] output rows (MOE_DOWN_TOKENS)
    slices = down_slices(topk_ids, rows.numel(), bm, down_tokens, (pairs, block_expert))
    for start, end, pairs, block_expert in slices:
        rows_out = torch.empty(((end - start) * k, hidden), dtype=x.dtype, device=x.device)
        _grouped_down_kernel[(block_expert.numel(), hidden // bn)](
            act[start * k : end * k], pairs, block_expert, rows, weights[start * k : end * k],
            pool["down_qweight"], pool["down_scales"], pool["down_zeros"], rows_out, hidden, inter,
            GROUPS=inter // GROUP, **launch,
        )  # fmt: skip
        out[start:end] = rows_out.view(end - start, k, hidden).sum(1, dtype=torch.float32)  # no fp32 [n·k, H]
    return out
