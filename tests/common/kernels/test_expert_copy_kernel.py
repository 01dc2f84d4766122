"""One launch for all of an expert's components against indexing: rows of different word counts, padding
pairs skipped, any number of programs sharing the work, and the fall back (False) when a row is not whole
words."""

from __future__ import annotations

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    ("programs", "block_words"), [(None, 2048), (1, 2048), (5, 2048), (None, 64), (3, 8)]
)
def test_copy_parts_matches_indexing(programs: int | None, block_words: int) -> None:
    """small block_words: components in several chunks of their own (the last one partial)."""
    from common.kernels.expert_copy import copy_parts

    gen = torch.Generator().manual_seed(0)
    shapes = [
        ((6, 40), torch.uint8),
        ((6, 3), torch.bfloat16),
        ((4100,), torch.float32),
    ]  # 10, 1.5?, 4100 words
    shapes[1] = ((6, 4), torch.bfloat16)  # 12 words
    parts = []
    for shape, dtype in shapes:
        src = torch.randint(0, 100, (5, *shape), generator=gen).to(dtype)
        parts.append((src.to(DEVICE), torch.zeros((7, *shape), dtype=dtype, device=DEVICE)))
    src_ids = torch.tensor([3, 0, 4, 1, 2], device=DEVICE)
    dst_rows = torch.tensor([6, 2, 0, 5, 1], device=DEVICE)
    valid = torch.tensor([True, True, False, True, False], device=DEVICE)  # padding inside and after
    assert copy_parts(parts, src_ids, dst_rows, valid, programs, block_words)
    for src, dst in parts:
        want = torch.zeros_like(dst)
        want[dst_rows[valid]] = src[src_ids[valid]]
        assert torch.equal(dst, want)
    odd = [
        (
            torch.zeros(5, 3, dtype=torch.uint8, device=DEVICE),
            torch.zeros(7, 3, dtype=torch.uint8, device=DEVICE),
        )
    ]
    assert not copy_parts(odd, src_ids, dst_rows, valid)
