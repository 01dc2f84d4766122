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
chunk, component) items: 32 × 8 KiB in flight covers the link's latency (55 GB/s × ~2 µs ≈ 110 KB). One
program per item (~1,000 for a few int4 experts) fills every SM with programs waiting on PCIe, and compute
launched after them queues until the last is dispatched: with lookahead on the model's own routing, 41.7 →
49.1 tok/s (decode-1 --routing model --lookahead 4, H200). Copies the compute waits for anyway (a layer's
misses) keep one program per item: 75.2 tok/s against 72.5 with 32 programs (decode-1, synthetic-zipf, one
machine, back to back)."""


@triton.jit
def _copy_parts_kernel(
    s0, d0, w0, s1, d1, w1, s2, d2, w2, s3, d3, w3, s4, d4, w4, s5, d5, w5,
    src_ids_ptr, dst_rows_ptr, valid_ptr, items, chunks, PARTS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    for item in range(tl.program_id(0), items, tl.num_programs(0)):  # (pair · chunks + chunk) · PARTS + part
        pair = item // (chunks * PARTS)
        if tl.load(valid_ptr + pair) != 0:
            src, dst, offs = _pair(src_ids_ptr, dst_rows_ptr, pair, (item // PARTS) % chunks, BLOCK)
            part = item % PARTS
            if part == 0:
                _copy_part(s0, d0, w0, src, dst, offs)
            elif part == 1:
                _copy_part(s1, d1, w1, src, dst, offs)
            elif part == 2:
                _copy_part(s2, d2, w2, src, dst, offs)
            elif part == 3:
                _copy_part(s3, d3, w3, src, dst, offs)
            elif part == 4:
                _copy_part(s4, d4, w4, src, dst, offs)
            else:
                _copy_part(s5, d5, w5, src, dst, offs)


def copy_parts(
    parts: list[tuple[torch.Tensor, torch.Tensor]],
    src_ids: torch.Tensor,
    dst_rows: torch.Tensor,
    valid: torch.Tensor,
    programs: int | None = None,
) -> bool:
    """`copy_rows` for up to MAX_PARTS (src, dst) pairs of one expert's components in one launch of
    `programs` programs (default: one per 8 KiB chunk of a component of a pair), when every row is whole
    4-byte words; returns False (nothing copied) otherwise, for per-component launches."""
    if not 0 < len(parts) <= MAX_PARTS or src_ids.numel() == 0:
        return False
    args, longest = [], 0
    for src, dst in parts:
        row_bytes = src[0].numel() * src.element_size() if src.shape[0] else 0
        if row_bytes == 0 or word_dtype(row_bytes, src, dst) != torch.int32 or src.shape[1:] != dst.shape[1:]:
            return False
        source, dest = as_words(src, torch.int32), as_words(dst, torch.int32)
        args += [source, dest, source.shape[1]]
        longest = max(longest, source.shape[1])
    args += args[-3:] * (MAX_PARTS - len(parts))  # unused slots: never reached (part < PARTS)
    chunks = triton.cdiv(longest, BLOCK_WORDS)
    items = src_ids.numel() * chunks * len(parts)
    programs = items if programs is None else min(programs, items)
    _copy_parts_kernel[(programs,)](
        *args, src_ids.contiguous(), dst_rows.contiguous(), valid.contiguous().view(torch.uint8), items,
        chunks, PARTS=len(parts), BLOCK=BLOCK_WORDS,
    )  # fmt: skip
    return True
