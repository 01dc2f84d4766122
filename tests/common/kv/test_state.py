"""State pools: page/slot allocation, slot zeroing, and the batch layout the backends plan from."""

from __future__ import annotations

import pytest
import torch

from common.kv.batch import ForwardBatch
from common.kv.state import PagedSpec, PoolExhausted, SlotSpec, StatePool


def _pool(num_pages: int = 8, max_seqs: int = 3) -> StatePool:
    specs = [
        {"k": PagedSpec((2, 4), torch.float32), "v": PagedSpec((2, 4), torch.float32)},
        {"recurrent": SlotSpec((3, 3), torch.float32), "conv": SlotSpec((5,), torch.float32)},
    ]
    return StatePool(specs, num_pages=num_pages, page_size=4, max_seqs=max_seqs, device="cpu")


def test_pool_shapes_mix_paged_and_slot_state() -> None:
    pool = _pool()
    assert pool.layer(0).paged["k"].shape == (8, 4, 2, 4)
    assert pool.layer(0).slots == {}
    assert pool.layer(1).slots["recurrent"].shape == (3, 3, 3)
    assert pool.layer(1).paged == {}


def test_reserve_and_release_pages() -> None:
    pool = _pool()
    seq = pool.new_sequence()
    pool.reserve(seq, 9)  # 3 pages of 4
    assert len(seq.pages) == 3 and pool.pages.num_free == 5
    pool.reserve(seq, 12)  # still 3
    assert len(seq.pages) == 3
    pool.release(seq)
    assert pool.pages.num_free == 8 and pool.slots.num_free == 3


def test_exhaustion_is_an_error() -> None:
    pool = _pool(num_pages=2, max_seqs=1)
    seq = pool.new_sequence()
    with pytest.raises(PoolExhausted):
        pool.reserve(seq, 9)
    with pytest.raises(PoolExhausted):
        pool.new_sequence()


def test_new_sequence_zeroes_its_slot() -> None:
    pool = _pool()
    seq = pool.new_sequence()
    pool.layer(1).slots["recurrent"][seq.slot].fill_(7.0)
    pool.release(seq)
    again = pool.new_sequence()
    while again.slot != seq.slot:
        again = pool.new_sequence()
    assert pool.layer(1).slots["recurrent"][again.slot].abs().sum() == 0


def test_batch_layout() -> None:
    pool = _pool()
    a, b = pool.new_sequence(), pool.new_sequence()
    a.num_cached = 5
    pool.reserve(a, 6)
    pool.reserve(b, 3)
    batch = ForwardBatch.build([a, b], [[9], [1, 2, 3]], page_size=4, device="cpu")
    assert batch.positions.tolist() == [5, 0, 1, 2]
    assert batch.seq_index.tolist() == [0, 1, 1, 1]
    assert batch.kv_lens == [6, 3]
    assert batch.last_token_index().tolist() == [0, 3]
    assert not batch.is_decode
    assert batch.page_table.shape == (2, 2)


@pytest.mark.parametrize("chunk", [256, 1])
def test_a_forked_sequence_continues_like_its_source(tmp_path, monkeypatch, chunk: int) -> None:
    """Its copy a page at a time too (StatePool.copy's chunks)."""
    from common.engine.runner import ModelRunner
    from common.kv import state
    from common.model.loader import load_model
    from common.model.synthetic.checkpoint import make_model

    model = load_model(make_model(tmp_path / "m", preset="tiny", arch="qwen4_exp"), dtype=torch.float32)
    runner = ModelRunner(model, max_running=3, max_context=64)
    source = runner.new_sequence()
    token = int(runner.forward([source], [list(range(3, 40))]).argmax(-1))  # pages, conv, recurrent, n-gram
    monkeypatch.setattr(state, "COPY_PAGES", chunk)
    twin = runner.pool.fork(source)
    assert twin.slot != source.slot and not set(twin.pages) & set(source.pages)
    for _ in range(4):  # both decode side by side, as one batch: the same logits (to batched rounding)
        logits = runner.forward([source, twin], [[token], [token]])
        torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
        token = int(logits[0].argmax())


def test_allocator_hands_out_the_lowest_free_indices_below_its_limit() -> None:
    """Lowest first after frees too (the pages in use stay packed at the bottom); past the limit `on_short`
    is asked to raise it, and without it the alloc is refused; every free calls `on_free`."""
    from common.kv.state import IndexAllocator

    pages = IndexAllocator(10)
    first = pages.alloc(4)
    pages.free([first[1], first[3]])
    assert pages.alloc(2) == [1, 3] and pages.high_water() == 4
    pages.limit = 5
    with pytest.raises(PoolExhausted, match="past the limit 5"):
        pages.alloc(2)
    asked, freed = [], []
    pages.on_short = lambda end: (asked.append(end), setattr(pages, "limit", 8))
    pages.on_free = lambda: freed.append(pages.high_water())
    assert pages.alloc(2) == [4, 5] and asked == [6] and pages.limit == 8
    pages.free([5, 4])
    assert freed == [4] and pages.num_free == 6
