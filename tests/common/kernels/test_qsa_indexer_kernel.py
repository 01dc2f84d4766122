"""QSA's indexer on decode steps with its Triton kernels against the torch path: the same block keys
written (complete and incomplete blocks, sequences in scattered pages) and the same key selection."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from common.engine.runner import ModelRunner
from common.kernels.config import KERNELS
from common.kv.batch import ForwardBatch
from common.model.context import ForwardContext
from common.model.loader import load_model
from common.model.qwen4_exp.qsa import QSAttention
from common.model.synthetic.checkpoint import make_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _select(model, indexer, runner: ModelRunner, batch: ForwardBatch, x: torch.Tensor, fused: bool):
    """The indexer's selection for the pass `batch` of hidden states x, on the fused path or torch's."""
    ctx = ForwardContext(batch, runner.pool, runner.backend, runner.backend.plan(batch))
    model._set_rotary(ctx, x.dtype)
    indexer.fused_decode = fused
    return indexer(indexer.index_qk_proj(x), ctx)


def test_fused_indexer_matches_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused decode path (block keys, scores, selection) against torch's: the same raw and block keys
    written and the same keys selected up to ties (ReLU'd scores tie at 0; both paths take the lower block,
    but the scores may differ in their last bits): the chosen blocks' scores agree, and the incomplete
    block's keys."""
    from common.kernels import qsa_indexer

    seen = []
    select = qsa_indexer.select_blocks
    monkeypatch.setattr(
        qsa_indexer, "select_blocks", lambda scores, *a: seen.append(scores) or select(scores, *a)
    )
    sparse = {"indexer_budget": 8, "indexer_compress_ratio": 4}
    path = make_model(tmp_path / "m", preset="tiny", arch="qwen4_exp", overrides=sparse)
    model = load_model(path, dtype=torch.float32, device=DEVICE)
    attention = next(m for m in model.modules() if isinstance(m, QSAttention))
    indexer = attention.indexer
    runner = ModelRunner(model, max_running=3, max_context=64)
    seqs = [runner.new_sequence() for _ in range(3)]
    gen = torch.Generator().manual_seed(0)
    for seq, n in zip(seqs, (17, 19, 13), strict=True):  # the new tokens complete a block (19) or not
        runner.forward([seq], [torch.randint(3, 500, (n,), generator=gen).tolist()])
    for seq in seqs:
        runner.pool.reserve(seq, seq.num_cached + 1)
    batch = ForwardBatch.build(seqs, [[7], [8], [9]], runner.pool.page_size, DEVICE)
    x = torch.randn(3, model.config.hidden_size, generator=gen).to(DEVICE)
    paged = runner.pool.layer(indexer.layer_idx).paged
    results = []
    for fused in (False, True):
        saved = {name: t.clone() for name, t in paged.items()}
        selected = _select(model, indexer, runner, batch, x, fused)
        results.append((selected, paged["index_block"].clone(), paged["index_k"].clone()))
        for name, t in paged.items():
            t.copy_(saved[name])
    (want_sel, want_blocks, want_raw), (got_sel, got_blocks, got_raw) = results
    torch.testing.assert_close(got_blocks, want_blocks, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_raw, want_raw)  # the raw keys stored by the compress kernel, as by torch
    (scores,), r = seen, indexer.ratio
    assert got_sel.shape == want_sel.shape and torch.equal(got_sel[:, -(r - 1) :], want_sel[:, -(r - 1) :])
    for got_row, want_row, row_scores in zip(got_sel, want_sel, scores, strict=True):
        blocks = [row[: -(r - 1)][row[: -(r - 1)] >= 0][::r] // r for row in (got_row, want_row)]
        torch.testing.assert_close(row_scores[blocks[0]].sort().values, row_scores[blocks[1]].sort().values)


def test_prefill_block_scores_match_torch() -> None:
    """Tiles past both edges (37 queries, 70 blocks, tiles of 16 and 64) into strided output rows (a buffer
    wider than the blocks), against the torch path's einsum, ReLU and sum over heads."""
    from common.kernels.qsa_indexer import prefill_block_scores  # Triton

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(37, 4, 32, generator=gen).to(DEVICE)
    keys = torch.randn(70, 32, generator=gen).to(DEVICE)
    want = torch.einsum("thd,nd->thn", q, keys).relu().sum(1) / 32**0.5
    for block in (16, 64):
        out = torch.full((37, 96), 7.0, device=DEVICE)
        prefill_block_scores(q, keys, out[:, :70], block)
        torch.testing.assert_close(out[:, :70], want, rtol=1e-5, atol=1e-5)
        assert bool((out[:, 70:] == 7.0).all())  # nothing written past the blocks


def test_fused_prefill_selection_matches_torch(tmp_path: Path) -> None:
    """A prefill pass past the indexer's budget (two sequences, one with cached tokens): the Triton scores
    select the same keys as the torch path's."""
    sparse = {"indexer_budget": 8, "indexer_compress_ratio": 4}
    path = make_model(tmp_path / "m", preset="tiny", arch="qwen4_exp", overrides=sparse)
    model = load_model(path, dtype=torch.float32, device=DEVICE)
    indexer = next(m for m in model.modules() if isinstance(m, QSAttention)).indexer
    runner = ModelRunner(model, max_running=2, max_context=64)
    seqs = [runner.new_sequence() for _ in range(2)]
    gen = torch.Generator().manual_seed(1)
    runner.forward([seqs[0]], [torch.randint(3, 500, (13,), generator=gen).tolist()])
    new = [[int(i) for i in torch.randint(3, 500, (n,), generator=gen)] for n in (21, 30)]
    for seq, ids in zip(seqs, new, strict=True):
        runner.pool.reserve(seq, seq.num_cached + len(ids))
    batch = ForwardBatch.build(seqs, new, runner.pool.page_size, DEVICE)
    x = torch.randn(51, model.config.hidden_size, generator=gen).to(DEVICE)
    selections = [_select(model, indexer, runner, batch, x, fused) for fused in (False, True)]
    want, got = selections
    assert want is not None and got is not None
    assert torch.equal(got.sort(1).values, want.sort(1).values)


@pytest.mark.parametrize("ways", [0, 2, 4, 16])
def test_select_blocks_chooses_top_k_keys(monkeypatch: pytest.MonkeyPatch, ways: int) -> None:
    """The select kernels against torch's top-k and expansion (QSAIndexer._select's torch ops): the same keys
    (order aside) for queries that see no block, fewer blocks than k, and many; with ties at the threshold
    (the lower blocks win) and with k above the block count, the chosen keys in block order. `ways` 0: the
    ranks (the default; programs of 8 blocks here, 64 a query, the last to arrive writing); else the
    threshold search cut in `ways` parts a round (2: the bisection)."""
    from common.kernels import qsa_indexer
    from common.kernels.qsa_indexer import select_blocks

    kernels = replace(KERNELS, select_rank=ways == 0)
    monkeypatch.setattr(qsa_indexer, "SELECT_WAYS", ways or 4)
    monkeypatch.setattr(qsa_indexer, "RANK_TILE", 8 * 512)  # 300 blocks: ranked against 512

    gen = torch.Generator().manual_seed(3)
    r, num_blocks = 4, 300
    positions = torch.tensor([0, 2, 13, 600, 1199, 1203])  # visible blocks: 0, 0, 3, 150, 300, 300
    scores = torch.rand(6, num_blocks, generator=gen)
    scores[4, :10], scores[4, 10:110] = 0.9, 0.5  # with k = 64: 10 above, 54 of 100 ties at the threshold
    scores[4, 110:] = torch.rand(190, generator=gen) * 0.4
    unseen = torch.arange(num_blocks)[None, :] >= ((positions + 1) // r)[:, None]
    for topk in (64, 512):
        k = min(topk, num_blocks)
        top_scores, top_blocks = scores.masked_fill(unseen, float("-inf")).topk(k, dim=-1)
        live = top_scores > float("-inf")
        if topk == 64:  # torch takes any 54 of the tied blocks; the kernel the lowest
            top_blocks[4] = torch.arange(k)
        offsets = torch.arange(r)
        chosen = torch.where(live[..., None], top_blocks[..., None] * r + offsets, -1).flatten(1)
        tail = ((positions + 1) // r)[:, None] * r + offsets[: r - 1]
        want = torch.cat([chosen, torch.where(tail <= positions[:, None], tail, -1)], dim=1)
        got = select_blocks(scores.to(DEVICE), positions.to(DEVICE), topk, r, kernels).cpu()
        assert got.shape == want.shape
        assert torch.equal(got.sort(1).values, want.sort(1).values), topk
        for row in got[:, : k * r]:  # the chosen blocks' keys, in block order, then −1
            keys = row[row >= 0]
            assert torch.equal(row[: keys.numel()], keys) and bool((keys.diff() > 0).all())


def test_fused_decode_selection_before_the_first_block(tmp_path: Path) -> None:
    """A decode step that sees no complete block yet (a one-token prompt: 2 keys, blocks of 4) selects on
    the fused path as on torch's: only its own keys."""
    sparse = {"indexer_budget": 8, "indexer_compress_ratio": 4}
    path = make_model(tmp_path / "m", preset="tiny", arch="qwen4_exp", overrides=sparse)
    model = load_model(path, dtype=torch.float32, device=DEVICE)
    indexer = next(m for m in model.modules() if isinstance(m, QSAttention)).indexer
    runner = ModelRunner(model, max_running=1, max_context=64)
    seq = runner.new_sequence()
    runner.forward([seq], [[5]])
    runner.pool.reserve(seq, seq.num_cached + 1)
    batch = ForwardBatch.build([seq], [[7]], runner.pool.page_size, DEVICE)
    x = torch.randn(1, model.config.hidden_size, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    selections = [_select(model, indexer, runner, batch, x, fused) for fused in (False, True)]
    assert selections[0].tolist() == selections[1].tolist() == [[0, 1, -1]]
