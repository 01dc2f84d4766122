"""MTP speculative decoding gives exactly the greedy tokens of plain decoding, whatever the drafts are."""

from __future__ import annotations

import pytest
import torch

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.engine.speculative import MTPSpeculator
from common.model.errors import CheckpointError
from common.model.synthetic.checkpoint import make_model
from common.protocol import SamplingParams

OVERRIDES = {"indexer_n_heads": 16, "indexer_budget": 16, "mtp_num_hidden_layers": 1}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("mtp"), preset="tiny", arch="qwen4_exp", overrides=OVERRIDES)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (7, 41, 22)]


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    engine = Engine(WorkerConfig(str(model_dir), max_running=3, max_context=96))
    return [r.token_ids for r in engine.generate(prompts, GREEDY)]


@pytest.mark.parametrize("num_draft", [1, 3])
def test_mtp_head_drafts_give_greedy_tokens(model_dir, prompts, reference, num_draft):
    engine = Engine(
        WorkerConfig(str(model_dir), max_running=2, max_context=96, speculative="mtp", num_draft=num_draft)
    )
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == reference
    assert engine.runner.pool.pages.num_free == engine.runner.pool.pages.size


@pytest.mark.parametrize("wrong_at", [None, 0, 2])
def test_oracle_drafts_exercise_acceptance_and_rollback(model_dir, prompts, reference, wrong_at, monkeypatch):
    """Drafts that are right up to `wrong_at` (all right when None): accepted runs, then a rollback."""
    engine = Engine(
        WorkerConfig(str(model_dir), max_running=3, max_context=96, speculative="mtp", num_draft=4)
    )
    truth = {}  # slot -> the full greedy sequence of the request in that slot
    accepted = []
    original_catch_up, original_step = MTPSpeculator._catch_up, MTPSpeculator.step

    def catch_up(self, seqs, starts, nexts, streams):
        original_catch_up(self, seqs, starts, nexts, streams)
        for seq in seqs:
            drafts = self.drafts[seq.slot]
            future = truth[seq.slot][drafts.mtp_cached + 1 : drafts.mtp_cached + 1 + self.num_draft]
            drafts.tokens = [t if i != wrong_at else (t + 1) % 1000 for i, t in enumerate(future)]

    def step(self, seqs, last):
        emitted = original_step(self, seqs, last)
        accepted.extend(len(e) - 1 for e in emitted)
        return emitted

    monkeypatch.setattr(MTPSpeculator, "_catch_up", catch_up)
    monkeypatch.setattr(MTPSpeculator, "step", step)
    slots = iter(range(3))
    original_new = engine.runner.new_sequence

    def new_sequence():
        seq = original_new()
        b = next(slots)
        truth[seq.slot] = prompts[b] + reference[b]
        return seq

    monkeypatch.setattr(engine.runner, "new_sequence", new_sequence)
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == reference
    expected = 4 if wrong_at is None else wrong_at
    assert max(accepted) == expected  # drafts were accepted up to the first wrong one


def test_sampling_requests_are_refused(model_dir, prompts):
    engine = Engine(WorkerConfig(str(model_dir), max_running=1, max_context=96, speculative="mtp"))
    with pytest.raises(ValueError, match="greedy"):
        engine.generate(prompts[:1], SamplingParams(temperature=0.7))


def test_checkpoint_without_mtp_head(tmp_path):
    plain = make_model(
        tmp_path / "plain", preset="tiny", arch="qwen4_exp", overrides={"mtp_num_hidden_layers": 0}
    )
    with pytest.raises(CheckpointError, match="no MTP head"):
        Engine(WorkerConfig(str(plain), speculative="mtp"))


def test_only_prompt_tokens_are_counted_in_the_cache_statistics(model_dir, prompts):
    """An offloaded speculative engine counts each prompt's tokens once in the cache statistics: its MTP
    verifications, re-runs and drafts are not prompts."""
    engine = Engine(
        WorkerConfig(
            str(model_dir), max_running=2, max_context=96, speculative="mtp", num_draft=2, expert_cache="0.5"
        )
    )
    observed = []
    observe = engine.offload.tables.observe

    def counting(layer: int, ids: torch.Tensor) -> None:
        observed.append((layer, ids.shape[0]))
        observe(layer, ids)

    engine.offload.tables.observe = counting
    engine.generate(prompts, GREEDY)
    trunk = len(engine.config.moe_layers) - 1  # the MTP head's MoE layer, the last, sees drafts only
    per_layer = {layer: sum(n for i, n in observed if i == layer) for layer, _ in observed}
    assert sorted(per_layer) == list(range(trunk)) and set(per_layer.values()) == {sum(map(len, prompts))}


def test_mtp_with_lent_kv_pages_gives_greedy_tokens(model_dir, prompts, reference):
    """Verify passes reserve several pages at once: with KV lending they take lent pages back (and finished
    sequences lend them again) without changing a token."""
    engine = Engine(
        WorkerConfig(
            str(model_dir),
            max_running=2,
            max_context=96,
            speculative="mtp",
            num_draft=2,
            expert_cache="0.25",
            lend_kv=True,
        )
    )
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == reference
    assert engine.kv_lending.raises > 0 and engine.offload.tables.lent > 0
    engine.offload.tables.check()
