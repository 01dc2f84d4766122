"""QSA's indexer on a decode step as Triton kernels (common/model/qwen4_exp/qsa.py `QSAIndexer`).

- `compress_step`: each token's block key (the mean of the block's raw indexer keys up to the token,
  RMS-normalised with weight (1 + w), rotated at the block's first position) at the block's first slot.
- `block_scores`: a query's score per complete block it sees, Σ_heads relu(q_h · key) / √D, else −inf.
- `select_blocks`: a query's keys: its top-k blocks' and its own incomplete block's. Programs of a few blocks
  count each block's rank, and the last to arrive writes the chosen keys (KernelConfig.select_rank off: a
  program a query searches the k-th largest score's bits SELECT_WAYS ways; up to SELECT_MAX_BLOCKS blocks).
- `prefill_block_scores` (prefill): one sequence's queries × its block keys, tiled, the heads summed in
  registers: only [T, NB] is written.

Rotary pairs (entry i with i ± rot/2) are computed twice, once per entry, from memory: no register shuffle.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from common.kernels import arrival
from common.kernels.arrival import arrive
from common.kernels.config import KERNELS, KernelConfig
from common.kernels.norm_rope import Rotary
from common.kernels.pdl import gdc_enter, launch


@triton.jit
def _pooled(raw_ptr, new, table_ptr, seq, start, pos, cols, table_width, page_size, R: tl.constexpr, D):
    """Mean of the block's raw keys at columns `cols` (members past `pos` clamped to it), fp32; the key at
    `pos` is `new` (the token's own, [cols] in the store's dtype: not in its page yet)."""
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for m in tl.static_range(R):
        member = tl.minimum(start + m, pos)
        page = tl.load(table_ptr + seq * table_width + member // page_size).to(tl.int64)
        at = raw_ptr + (page * page_size + member % page_size) * D + cols
        stored = tl.load(at, mask=cols * 0 + member != pos, other=0.0)  # (a mask of the block's shape)
        acc += tl.where(member == pos, new, stored).to(tl.float32)
    return acc / R


@triton.jit
def _compress_kernel(
    raw_ptr, new_ptr, new_stride, blocks_ptr, table_ptr, pos_ptr, rope_ptr, w_ptr, inv_freq_ptr, table_width,
    page_size, eps, scaling, rot, R: tl.constexpr, D: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(GDC)
    _compress_token(
        raw_ptr, new_ptr, new_stride, blocks_ptr, table_ptr, pos_ptr, rope_ptr, w_ptr, inv_freq_ptr,
        table_width, page_size, eps, scaling, rot, tl.program_id(0), R, D,
    )  # fmt: skip


@triton.jit
def _compress_token(
    raw_ptr, new_ptr, new_stride, blocks_ptr, table_ptr, pos_ptr, rope_ptr, w_ptr, inv_freq_ptr, table_width,
    page_size, eps, scaling, rot, t, R: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    """Token t's raw key stored and its block's key written (rotated at the block's first rotary position:
    the token's, rope_ptr[t], less its offset in the block): the kernel's program t, and a program of
    common/kernels/qsa_prologue.py."""
    pos = tl.load(pos_ptr + t)
    start = pos - pos % R
    rope_start = tl.load(rope_ptr + t) - pos % R
    i = tl.arange(0, D)
    half = rot // 2
    partner = tl.where(i < half, i + half, i - half)
    rotated = i < rot
    new = tl.load(new_ptr + t * new_stride + i).to(raw_ptr.dtype.element_ty)  # the token's raw key, stored
    at = tl.load(table_ptr + t * table_width + pos // page_size).to(tl.int64) * page_size + pos % page_size
    tl.store(raw_ptr + at * D + i, new)
    new_other = tl.load(new_ptr + t * new_stride + partner).to(raw_ptr.dtype.element_ty)
    pooled = _pooled(raw_ptr, new, table_ptr, t, start, pos, i, table_width, page_size, R, D)
    pooled = pooled.to(blocks_ptr.dtype.element_ty).to(tl.float32)  # torch rounds the mean to the key dtype
    other = _pooled(raw_ptr, new_other, table_ptr, t, start, pos, partner, table_width, page_size, R, D)
    other = other.to(blocks_ptr.dtype.element_ty).to(tl.float32)
    factor = tl.math.rsqrt(tl.sum(pooled * pooled, axis=0) / D + eps)
    normed = pooled * factor * (1.0 + tl.load(w_ptr + i).to(tl.float32))
    other = other * factor * (1.0 + tl.load(w_ptr + partner).to(tl.float32))
    inv_freq = tl.load(inv_freq_ptr + i % tl.maximum(half, 1), mask=rotated, other=0.0)
    freq = rope_start.to(tl.float32) * inv_freq
    cos = tl.where(rotated, tl.cos(freq) * scaling, 1.0)
    sin = tl.where(rotated, tl.sin(freq) * scaling, 0.0)
    out = normed * cos + tl.where(i < half, -other, other) * sin
    page = tl.load(table_ptr + t * table_width + start // page_size).to(tl.int64)
    tl.store(blocks_ptr + (page * page_size + start % page_size) * D + i, out.to(blocks_ptr.dtype.element_ty))


@triton.jit
def _scores_kernel(
    q_ptr, blocks_ptr, table_ptr, pos_ptr, out_ptr, num_blocks, table_width, page_size,
    R: tl.constexpr, D: tl.constexpr, HEADS: tl.constexpr, BN: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(GDC)
    t, tile = tl.program_id(0), tl.program_id(1)
    n = tile * BN + tl.arange(0, BN)  # [BN] block indices
    visible = (tl.load(pos_ptr + t) + 1) // R
    seen = (n < visible) & (n < num_blocks)
    first = tl.where(seen, n * R, 0)
    page = tl.load(table_ptr + t * table_width + first // page_size, mask=seen, other=0).to(tl.int64)
    d = tl.arange(0, D)
    rows = (page * page_size + first % page_size)[:, None] * D + d[None, :]
    keys = tl.load(blocks_ptr + rows, mask=seen[:, None], other=0.0).to(tl.float32)  # [BN, D]
    score = tl.zeros((BN,), dtype=tl.float32)
    for h in tl.static_range(HEADS):
        q = tl.load(q_ptr + (t * HEADS + h) * D + d).to(tl.float32)
        score += tl.maximum(tl.sum(keys * q[None, :], axis=1), 0.0)
    score = tl.where(seen, score / tl.sqrt(D * 1.0), float("-inf"))
    tl.store(out_ptr + t * num_blocks + n, score, mask=n < num_blocks)


class KeyBlocks(NamedTuple):
    """A decode pass's indexer keys to store and compress: the flat paged raw keys and block keys [slots, Di],
    the pass's raw keys new [T, Di] (rows may be strided: a view of the fused projection's output; the last
    dim contiguous), the page table (sequence t's pages in row t), its page size, the key norm's weight [Di]
    and eps, tokens a block."""

    raw: torch.Tensor
    new: torch.Tensor
    blocks: torch.Tensor
    page_table: torch.Tensor
    page_size: int
    weight: torch.Tensor
    eps: float
    ratio: int


def compress_step(
    keys: KeyBlocks,
    positions: torch.Tensor,
    rope_positions: torch.Tensor,
    rotary: Rotary,
    kernels: KernelConfig = KERNELS,
) -> None:
    """One token per sequence, at `positions` [T] (rotated at `rope_positions` [T]): store each token's raw
    key at its position, and write its block's key (normalised, rotated by `rotary` at the block's first
    rotary position)."""
    t = positions.shape[0]
    dim = keys.raw.shape[1]
    new = keys.new
    assert new.shape == (t, dim) and new.stride(1) == 1, "new: [T, D], its last dim contiguous"
    _compress_kernel[(t,)](
        keys.raw, new, new.stride(0), keys.blocks, keys.page_table, positions, rope_positions, keys.weight,
        rotary.inv_freq, keys.page_table.shape[1], keys.page_size, keys.eps, rotary.scaling,
        2 * rotary.inv_freq.numel(),
        R=keys.ratio, D=dim, **launch(positions.device, kernels=kernels),
    )  # fmt: skip


def block_scores(
    q: torch.Tensor, blocks: torch.Tensor, page_table: torch.Tensor, positions: torch.Tensor, page_size: int,
    ratio: int, num_blocks: int, block_n: int = 64,
    kernels: KernelConfig = KERNELS,
) -> torch.Tensor:  # fmt: skip
    """q [T, Hi, D] (normalised, rotated), blocks [slots, D] → scores [T, num_blocks] fp32 (−inf: unseen)."""
    t, heads, dim = q.shape
    out = torch.empty((t, num_blocks), dtype=torch.float32, device=q.device)
    _scores_kernel[(t, triton.cdiv(num_blocks, block_n))](
        q.contiguous(), blocks, page_table, positions, out, num_blocks, page_table.shape[1], page_size,
        R=ratio, D=dim, HEADS=heads, BN=block_n, **launch(q.device, kernels=kernels),
    )  # fmt: skip
    return out


@triton.jit
def _prefill_scores_kernel(
    q_ptr, k_ptr, out_ptr, queries, num_blocks, out_stride, norm,
    HEADS: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0) * BM + tl.arange(0, BM)  # [BM] queries
    j = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN] blocks
    d = tl.arange(0, D)
    live_i, live_j = i < queries, j < num_blocks
    keys = tl.load(k_ptr + j[:, None] * D + d[None, :], mask=live_j[:, None], other=0.0)  # [BN, D]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for h in tl.static_range(HEADS):
        q = tl.load(q_ptr + (i[:, None] * HEADS + h) * D + d[None, :], mask=live_i[:, None], other=0.0)
        acc += tl.maximum(tl.dot(q, tl.trans(keys.to(q.dtype)), input_precision=PRECISION), 0.0)
    out = out_ptr + i[:, None].to(tl.int64) * out_stride + j[None, :]
    tl.store(out, acc / norm, mask=live_i[:, None] & live_j[None, :])


def prefill_block_scores(q: torch.Tensor, keys: torch.Tensor, out: torch.Tensor, block: int = 64) -> None:
    """q [T, Hi, D] (normalised, rotated: one sequence's queries), keys [NB, D] (its block keys) → out [T, NB]
    fp32 (rows may be strided) = Σ_heads relu(q_h · key) / √D, every block (the caller masks the unseen).
    The products take q's dtype (bf16: exact products, fp32 sums, as torch's fp32 GEMM of the same values),
    fp32 ones in full IEEE fp32."""
    t, heads, dim = q.shape
    assert out.shape == (t, keys.shape[0]) and out.stride(1) == 1 and out.dtype == torch.float32
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32: ignored by 16-bit inputs
    _prefill_scores_kernel[(triton.cdiv(t, block), triton.cdiv(keys.shape[0], block))](
        q.contiguous(), keys.contiguous(), out, t, keys.shape[0], out.stride(0), math.sqrt(dim),
        HEADS=heads, D=dim, BM=block, BN=block, PRECISION=precision,
    )  # fmt: skip


SELECT_MAX_BLOCKS = 4096
"""Blocks `select_blocks` holds in one program's registers (a 16K context at 4 tokens a block)."""
RANK_TILE = 16384
"""Comparisons a rank program makes: it ranks RANK_TILE / blocks of its query's blocks (16 of 1,024)."""
SELECT_WAYS = 4
"""Parts the search cuts its threshold's range into a round (a power of two): one reduction counts the
keys at or above each part's start, so it finds the k-th largest of 2³² key values in 32 / log2(WAYS)
rounds. Past 4 a round's [WAYS, blocks] comparisons cost more than the rounds they save (bench.select_tune
times them)."""
SELECT_WARPS = 4
"""Warps of a search program (bench.select_tune)."""


@triton.jit
def _ordered_keys(row_ptr, n, num_blocks, visible):
    """Blocks n's scores as int32 keys ordered as the floats (row_ptr: the query's scores), and which are
    live (seen, above −inf)."""
    seen = (n < num_blocks) & (n < visible)
    score = tl.load(row_ptr + n, mask=seen, other=float("-inf"))
    bits = score.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF), score > float("-inf")


@triton.jit
def _write_keys(chosen, i, pos, visible, row, K: tl.constexpr, R: tl.constexpr, BK: tl.constexpr):
    """The query's selection row ← the keys of the blocks `chosen` [BN] (at i), in block order, −1 up to
    K·R, then those of its incomplete block up to the query."""
    slot = tl.cumsum(chosen.to(tl.int32), axis=0) - 1  # [BN] each chosen block's place in the output
    r = tl.arange(0, R)
    keys = ((i * R)[:, None] + r[None, :]).to(tl.int64)  # [BN, R] each block's key positions
    tl.store(row + (slot * R)[:, None] + r[None, :], keys, mask=chosen[:, None])
    count = tl.sum(chosen.to(tl.int32), axis=0)
    j = tl.arange(0, BK)
    tl.store(row + j, tl.full((BK,), -1, tl.int64), mask=(j >= count * R) & (j < K * R))
    own = visible * R + r  # the query's incomplete block: its keys up to the query
    tl.store(row + K * R + r, tl.where(own <= pos, own, -1), mask=r < R - 1)


@triton.jit
def _rank_kernel(
    scores_ptr, pos_ptr, chosen_ptr, count_ptr, out_ptr, num_blocks, width,
    K: tl.constexpr, R: tl.constexpr, BI: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(GDC)
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    visible = (pos + 1) // R
    row = scores_ptr + t * num_blocks
    j = tl.arange(0, BN)  # every block of the query
    key_j, live_j = _ordered_keys(row, j, num_blocks, visible)
    i = tl.program_id(1) * BI + tl.arange(0, BI)  # [BI] the blocks this program ranks
    key_i, live_i = _ordered_keys(row, i, num_blocks, visible)
    # rank: the live blocks ahead of it, a higher score or the same one at a lower block (ties: lower first)
    ahead = (key_j[None, :] > key_i[:, None]) | (
        (key_j[None, :] == key_i[:, None]) & (j[None, :] < i[:, None])
    )
    rank = tl.sum((ahead & live_j[None, :]).to(tl.int32), axis=1)  # [BI]
    tl.store(chosen_ptr + t * BN + i, (live_i & (rank < K)).to(tl.int8))
    if arrive(count_ptr + t, tl.num_programs(1)):  # the last program writes the keys, in block order
        chosen = tl.load(chosen_ptr + t * BN + j, cache_modifier=".cg") != 0
        _write_keys(chosen, j, pos, visible, out_ptr + t * width, K, R, BK)


@triton.jit
def _select_kernel(
    scores_ptr, pos_ptr, out_ptr, num_blocks, width, K: tl.constexpr, R: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, WAYS: tl.constexpr, ROUNDS: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(GDC)
    t = tl.program_id(0)
    i = tl.arange(0, BN)
    pos = tl.load(pos_ptr + t)
    visible = (pos + 1) // R
    key, live = _ordered_keys(scores_ptr + t * num_blocks, i, num_blocks, visible)
    key = key.to(tl.int64)
    lo, hi = tl.full([], -(2**31), tl.int64), tl.full([], 2**31 - 1, tl.int64)
    j = tl.arange(0, WAYS)[:, None]  # [WAYS, 1] the range's parts
    for _ in tl.static_range(ROUNDS):  # the largest threshold with K live keys at or above it
        step = (hi - lo + WAYS) // WAYS  # [lo, hi] in WAYS parts of `step` (≥ 1) from lo
        counts = tl.sum((live[None, :] & (key[None, :] >= lo + step * j)).to(tl.int32), axis=1)  # [WAYS]
        part = tl.sum((counts >= K).to(tl.int32), axis=0) - 1  # the highest part starting with ≥ K above
        part = tl.maximum(part, 0)  # (none: fewer than K live keys, and lo stays below them all)
        lo, hi = lo + step * part, tl.minimum(hi, lo + step * (part + 1) - 1)
    above = live & (key > lo)
    tie = live & (key == lo)
    room = K - tl.sum(above.to(tl.int32), axis=0)  # ties taken lowest block first
    chosen = above | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) <= room))
    _write_keys(chosen, i, pos, visible, out_ptr + t * width, K, R, BK)


def select_blocks(
    scores: torch.Tensor, positions: torch.Tensor, topk: int, ratio: int, kernels: KernelConfig = KERNELS
) -> torch.Tensor:
    """scores [T, NB] fp32 (−inf: unseen; 0 < NB ≤ SELECT_MAX_BLOCKS), positions [T] → key positions [T,
    k·ratio + ratio − 1] int64 (k = min(topk, NB) > 0): the keys of the k best-scoring blocks a query sees,
    in block order, then those of its incomplete block up to itself; −1 pads. The same keys as a stable
    descending sort's first k (`QSAIndexer._select`: ties to the lower block) for scores as the indexer
    makes them: no NaN, no −0 (ranked below +0 here)."""
    t, num_blocks = scores.shape
    assert min(num_blocks, topk) > 0 and num_blocks <= SELECT_MAX_BLOCKS, (num_blocks, topk)
    assert ratio & (ratio - 1) == 0, f"ratio {ratio}: a power of two"
    k = min(topk, num_blocks)
    out = torch.empty((t, k * ratio + ratio - 1), dtype=torch.int64, device=scores.device)
    scores = scores.contiguous()
    bn, bk = triton.next_power_of_2(max(num_blocks, 2)), triton.next_power_of_2(k * ratio)
    if kernels.select_rank:
        ranked = min(bn, max(1, RANK_TILE // bn))
        chosen = torch.empty((t, bn), dtype=torch.int8, device=scores.device)
        _rank_kernel[(t, bn // ranked)](
            scores, positions, chosen, arrival.counters(scores.device, t), out, num_blocks, out.shape[1],
            K=k, R=ratio, BI=ranked, BN=bn, BK=bk, **launch(scores.device, kernels=kernels),
        )  # fmt: skip
        return out
    _select_kernel[(t,)](
        scores, positions, out, num_blocks, out.shape[1], K=k, R=ratio, BN=bn, BK=bk, WAYS=SELECT_WAYS,
        ROUNDS=-(-32 // (SELECT_WAYS.bit_length() - 1)), num_warps=SELECT_WARPS,
        **launch(scores.device, kernels=kernels),
    )  # fmt: skip
    return out
