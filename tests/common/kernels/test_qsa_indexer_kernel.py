"""QSA's indexer on decode steps with its Triton kernels against the torch path: the same block keys
written (complete and incomplete blocks, sequences in scattered pages) and the same key selection."""

from __future__ import annotations

from pathlib import Path

import torch

from common.kv.batch import ForwardBatch
from common.model.context import ForwardContext
from common.model.loader import load_model
from common.model.qwen4_exp.qsa import QSAttention
from common.model.synthetic import make_model
from common.runner import ModelRunner

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_fused_indexer_matches_torch(tmp_path: Path) -> None:
    sparse = {"indexer_budget": 8, "indexer_compress_ratio": 4}
    path = make_model(tmp_path / "m", preset="tiny", arch="qwen4_exp", overrides=sparse)
    model = load_model(path, dtype=torch.float32, device=DEVICE)
    attention = next(m for m in model.modules() if isinstance(m, QSAttention))
    indexer = attention.indexer
    runner = ModelRunner(model, max_seqs=3, max_context=64)
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
        ctx = ForwardContext(batch, runner.pool, runner.backend, runner.backend.plan(batch))
        model._set_rotary(ctx, x.dtype)
        indexer.fused_decode = fused
        selected = indexer(indexer.index_qk_proj(x), ctx)
        results.append((selected, paged["index_block"].clone()))
        for name, t in paged.items():
            t.copy_(saved[name])
    (want_sel, want_blocks), (got_sel, got_blocks) = results
    torch.testing.assert_close(got_blocks, want_blocks, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_sel.sort(1).values, want_sel.sort(1).values)  # the same keys (order aside)


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
    runner = ModelRunner(model, max_seqs=2, max_context=64)
    seqs = [runner.new_sequence() for _ in range(2)]
    gen = torch.Generator().manual_seed(1)
    runner.forward([seqs[0]], [torch.randint(3, 500, (13,), generator=gen).tolist()])
    new = [[int(i) for i in torch.randint(3, 500, (n,), generator=gen)] for n in (21, 30)]
    for seq, ids in zip(seqs, new, strict=True):
        runner.pool.reserve(seq, seq.num_cached + len(ids))
    batch = ForwardBatch.build(seqs, new, runner.pool.page_size, DEVICE)
    x = torch.randn(51, model.config.hidden_size, generator=gen).to(DEVICE)
    selections = []
    for fused in (False, True):
        ctx = ForwardContext(batch, runner.pool, runner.backend, runner.backend.plan(batch))
        model._set_rotary(ctx, x.dtype)
        indexer.fused_decode = fused
        selections.append(indexer(indexer.index_qk_proj(x), ctx))
    want, got = selections
    assert want is not None and got is not None
    assert torch.equal(got.sort(1).values, want.sort(1).values)
