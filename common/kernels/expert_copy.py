"""Copy whole experts from the GPU-mapped host store into device rows (one Triton kernel per component).

A copy list has a fixed shape [P] (the step's worst case) and a `valid` mask, so it can be launched without
knowing on the host how many experts actually miss. Program (p, c) copies chunk c of pair p's row: it reads
`valid[p]` and returns at once when the pair is padding, so no byte of an invalid pair crosses PCIe. The GPU
reads the host row through the mapping (zero-copy), like `common/kernels/gather.py`; rows are treated as raw
bytes, moved in 4-byte words when the row size allows it (every format's rows do at realistic sizes).
`copy_parts` moves every component of the pairs in one launch, its programs looping over the work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_WORDS = 2048
"""Words one program copies: 8 KiB of int32 (enough bytes in flight per program to keep PCIe reads busy)."""


@triton.jit
def _copy_part(src_ptr, dst_ptr, row_words, src, dst, offs):
    mask = offs < row_words
    words = tl.load(src_ptr + src * row_words + offs, mask=mask)
    tl.store(dst_ptr + dst * row_words + offs, words, mask=mask)


@triton.jit
def _pair(src_ids_ptr, dst_rows_ptr, pair, chunk, BLOCK: tl.constexpr):
    """A valid pair's source row, destination row and the word offsets of its chunk `chunk`."""
    src = tl.load(src_ids_ptr + pair).to(tl.int64)
    dst = tl.load(dst_rows_ptr + pair).to(tl.int64)
    return src, dst, chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)


@triton.jit
def _copy_rows_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_rows_ptr, valid_ptr, row_words, BLOCK: tl.constexpr):
    pair = tl.program_id(0)
    if tl.load(valid_ptr + pair) == 0:
        return
    src, dst, offs = _pair(src_ids_ptr, dst_rows_ptr, pair, tl.program_id(1), BLOCK)
    _copy_part(src_ptr, dst_ptr, row_words, src, dst, offs)


def word_dtype(row_bytes: int, *tensors: torch.Tensor) -> torch.dtype:
    """The widest of int32 / int16 / uint8 that divides the row size and every tensor's start address."""
    for dtype in (torch.int32, torch.int16):
        size = dtype.itemsize
        if row_bytes % size == 0 and all(t.data_ptr() % size == 0 for t in tensors):
            return dtype
    return torch.uint8


def as_words(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[R, ...] contiguous tensor of any dtype → [R, row_bytes / word] view of its bytes as `dtype`."""
    return rows.reshape(rows.shape[0], -1).view(torch.uint8).view(dtype)


def copy_rows(
    src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_rows: torch.Tensor, valid: torch.Tensor
) -> None:
    """dst[dst_rows[p]] = src[src_ids[p]] for every p with valid[p], on the current CUDA stream.

    src [R, ...] a contiguous, GPU-mapped host tensor (or a device tensor); dst [R', ...] contiguous on the
    GPU with src's row shape and dtype; src_ids, dst_rows [P] int64 and valid [P] bool on the GPU.
    """
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise ValueError(f"rows differ: {src.dtype}{tuple(src.shape)} vs {dst.dtype}{tuple(dst.shape)}")
    pairs = src_ids.numel()
    row_bytes = src[0].numel() * src.element_size() if src.shape[0] else 0
    if pairs == 0 or row_bytes == 0:
        return
    word = word_dtype(row_bytes, src, dst)
    source, dest = as_words(src, word), as_words(dst, word)  # [R, W], [R', W]
    row_words = source.shape[1]
    grid = (pairs, triton.cdiv(row_words, BLOCK_WORDS))
    _copy_rows_kernel[grid](
        source,
        dest,
        src_ids.contiguous(),
        dst_rows.contiguous(),
        valid.contiguous().view(torch.uint8),
        row_words,
        BLOCK=BLOCK_WORDS,
    )


MAX_PARTS = 6
"""Components one `copy_experts_rows` launch can take (int4 has six: codes, scales, zeros of two matrices)."""


BACKGROUND_PROGRAMS = 32
"""Programs of a `copy_parts` launch that runs beside compute (a lookahead's), each looping over (pair,
chunk, component) items: 32 × 8 KiB in flight covers the host link's bandwidth-latency product. One program
per item would fill every SM with programs waiting on PCIe, and compute launched after them would queue until
the last is dispatched. Copies the compute waits for anyway (a layer's misses) keep one program per item."""


@triton.jit
def _copy_parts_kernel(
    s0, d0, w0, s1, d1, w1, s2, d2, w2, s3, d3, w3, s4, d4, w4, s5, d5, w5,
    src_ids_ptr, dst_rows_ptr, valid_ptr, pairs, c1, c2, c3, c4, c5, chunks,
    BLOCK: tl.constexpr, PB: tl.constexpr,
):  # fmt: skip
    if PB > 0:  # the work ends at the last valid pair (a step's misses come first in its copy list)
        p = tl.arange(0, PB)
        valid = tl.load(valid_ptr + p, mask=p < pairs, other=0) != 0
        items = tl.max(tl.where(valid, p + 1, 0), axis=0) * chunks
    else:
        items = pairs * chunks
    for item in range(tl.program_id(0), items, tl.num_programs(0)):  # pair · chunks + chunk of the parts
        pair = item // chunks
        if tl.load(valid_ptr + pair) != 0:
            chunk = item % chunks  # component k's chunks are [c_k, c_k+1): c0 = 0, unused parts empty
            if chunk < c1:
                _copy_chunk(s0, d0, w0, src_ids_ptr, dst_rows_ptr, pair, chunk, BLOCK)
            elif chunk < c2:
                _copy_chunk(s1, d1, w1, src_ids_ptr, dst_rows_ptr, pair, chunk - c1, BLOCK)
            elif chunk < c3:
                _copy_chunk(s2, d2, w2, src_ids_ptr, dst_rows_ptr, pair, chunk - c2, BLOCK)
            elif chunk < c4:
                _copy_chunk(s3, d3, w3, src_ids_ptr, dst_rows_ptr, pair, chunk - c3, BLOCK)
            elif chunk < c5:
                _copy_chunk(s4, d4, w4, src_ids_ptr, dst_rows_ptr, pair, chunk - c4, BLOCK)
            else:
                _copy_chunk(s5, d5, w5, src_ids_ptr, dst_rows_ptr, pair, chunk - c5, BLOCK)


@triton.jit
def _copy_chunk(src_ptr, dst_ptr, row_words, src_ids_ptr, dst_rows_ptr, pair, chunk, BLOCK: tl.constexpr):
    src, dst, offs = _pair(src_ids_ptr, dst_rows_ptr, pair, chunk, BLOCK)
    _copy_part(src_ptr, dst_ptr, row_words, src, dst, offs)


LIVE_PAIRS = 4096
"""Copy lists up to this long are scanned by every program for their last valid pair (one [P] load from
L2), so that no work is scheduled past it; longer ones cover every pair."""


def copy_parts(
    parts: list[tuple[torch.Tensor, torch.Tensor]],
    src_ids: torch.Tensor,
    dst_rows: torch.Tensor,
    valid: torch.Tensor,
    programs: int | None = None,
    block_words: int = BLOCK_WORDS,
) -> bool:
    """`copy_rows` for up to MAX_PARTS (src, dst) pairs of one expert's components in one launch of
    `programs` programs (default: one per `block_words` chunk of every component of every pair, each
    component cut into its own chunks), when every row is whole 4-byte words; returns False (nothing
    copied) otherwise, for per-component launches."""
    if not 0 < len(parts) <= MAX_PARTS or src_ids.numel() == 0:
        return False
    args, bounds = [], [0]
    for src, dst in parts:
        row_bytes = src[0].numel() * src.element_size() if src.shape[0] else 0
        if row_bytes == 0 or word_dtype(row_bytes, src, dst) != torch.int32 or src.shape[1:] != dst.shape[1:]:
            return False
        source, dest = as_words(src, torch.int32), as_words(dst, torch.int32)
        args += [source, dest, source.shape[1]]
        bounds.append(bounds[-1] + triton.cdiv(source.shape[1], block_words))
    args += args[-3:] * (MAX_PARTS - len(parts))  # unused slots: never reached (their chunks are empty)
    chunks = bounds[-1]
    bounds += [chunks] * (MAX_PARTS - len(bounds))  # [c0 .. c5]
    pairs = src_ids.numel()
    items = pairs * chunks
    programs = items if programs is None else min(programs, items)
    scan = triton.next_power_of_2(pairs) if pairs <= LIVE_PAIRS else 0
    _copy_parts_kernel[(programs,)](
        *args, src_ids.contiguous(), dst_rows.contiguous(), valid.contiguous().view(torch.uint8), pairs,
        *bounds[1:MAX_PARTS], chunks, BLOCK=block_words, PB=scan,
    )  # fmt: skip
    return True
