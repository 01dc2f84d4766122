"""AliasedMemory on the host (memfd + mmap): the shared pieces of two tensors are the same bytes, the rest
of each is its own."""

from __future__ import annotations

import pytest

from common.aliased import AliasedMemory


def test_shared_pieces_are_the_same_bytes_and_the_rest_is_private() -> None:
    memory = AliasedMemory(3 * AliasedMemory.granularity("cpu"), "cpu")
    c = memory.chunk
    a = memory.tensor(5 * c, [(c, 2 * c, 0)])  # a's chunks 1-2 are shared chunks 0-1
    b = memory.tensor(3 * c + 100, [(0, c, 2 * c), (2 * c, c, 0)])  # b's chunk 0: shared 2; b's 2: shared 0
    a.fill_(1)
    b.fill_(2)
    assert a.view(5, c)[:, 0].tolist() == [1, 2, 1, 1, 1]  # only shared chunk 0 is in both
    a[c : c + 10] = 7
    assert b[2 * c : 2 * c + 10].tolist() == [7] * 10
    assert b.numel() == 3 * c + 100 and memory.total_bytes == 3 * c + (5 - 2) * c + (4 - 2) * c
    del memory  # the tensors keep their mappings
    assert int(a.sum()) == 10 * 7 + (c - 10) * 2 + 4 * c  # chunk 1 as b left it, the rest 1


def test_pieces_must_be_whole_chunks_inside_and_apart() -> None:
    memory = AliasedMemory(2 * AliasedMemory.granularity("cpu"), "cpu")
    c = memory.chunk
    with pytest.raises(ValueError, match="whole chunks"):
        memory.tensor(4 * c, [(c // 2, c, 0)])
    with pytest.raises(ValueError, match="whole chunks"):
        memory.tensor(4 * c, [(0, c, 2 * c)])  # past the shared buffer
    with pytest.raises(ValueError, match="overlap"):
        memory.tensor(4 * c, [(0, 2 * c, 0), (c, c, 0)])
