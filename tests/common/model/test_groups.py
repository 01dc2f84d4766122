"""Grouped decode passes (common/model/groups.py) on the CPU: every decode pass of two or more lanes run as
two groups of lanes, layer by layer in turn, through an expert cache decodes the reference's tokens, and
the groups resolve each layer as steps of their own (their own previous steps) with the tables consistent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.model.context import ForwardContext
from common.model.groups import lane_groups, pass_groups
from common.model.synthetic.checkpoint import make_model
from common.protocol import SamplingParams

ARCHS = {"qwen3_moe": {}, "qwen4_exp": {"indexer_n_heads": 16, "indexer_budget": 8}}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_lane_groups_cover_the_lanes_in_order() -> None:
    assert lane_groups(8, 2) == [(0, 4), (4, 8)]
    assert lane_groups(5, 2) == [(0, 3), (3, 5)]
    assert lane_groups(1, 1) == [(0, 1)]


def test_pass_groups_split_where_the_cache_takes_two_groups(tmp_path: Path) -> None:
    """Two groups from `split_lanes` lanes on, only through an expert cache that copies (not all-resident,
    not resident experts), with a group's choices within its half of the staging rows (tiny: 8 experts,
    top-2, so at most two lanes a group), and never an empty group."""
    path = make_model(tmp_path / "m", preset="tiny", arch="qwen3_moe", seed=1)
    cached = Engine(WorkerConfig(str(path), max_running=4, expert_cache="0.5")).model
    assert pass_groups(cached, 4, 2) == 2 and pass_groups(cached, 3, 2) == 2
    assert pass_groups(cached, 6, 2) == 1  # three lanes a group: 6 choices, 4 staging rows
    assert pass_groups(cached, 4, 8) == pass_groups(cached, 4, 0) == pass_groups(cached, 1, 1) == 1
    assert pass_groups(Engine(WorkerConfig(str(path), max_running=4)).model, 4, 2) == 1
    all_fit = Engine(WorkerConfig(str(path), max_running=4, expert_cache="all"))
    all_fit.offload.load_all(release_host=False)
    assert pass_groups(all_fit.model, 4, 2) == 1


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (6, 23, 15)]


def _grouped(engine: Engine) -> list[int]:
    """Make every decode pass of two or more lanes run in two groups → a list that counts those passes."""
    model, passes = engine.model, []
    plain = model.forward

    def forward(ctx: ForwardContext) -> torch.Tensor:
        batch = ctx.batch
        if not batch.is_decode or batch.num_seqs < 2:
            return plain(ctx)
        parts = [batch.lanes(a, b) for a, b in lane_groups(batch.num_seqs, 2)]
        passes.append(len(parts))
        model.experts.regroup(len(parts))  # as DecodeGraphs.run before a grouped replay
        return model.forward_groups(
            [ForwardContext(p, ctx.pool, ctx.backend, ctx.backend.plan(p)) for p in parts]
        )

    model.forward = forward
    return passes


@pytest.mark.parametrize("replay", [None, "synthetic-zipf:seed=3"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_grouped_decode_decodes_the_reference_tokens(tmp_path: Path, arch: str, replay: str | None) -> None:
    """With the model's routing and with a replayed one (the groups take the trace's rows in lane order)."""
    path = make_model(tmp_path / "m", preset="tiny", arch=arch, overrides=ARCHS[arch], seed=1)
    prompts = _prompts()
    make = lambda: Engine(WorkerConfig(str(path), max_running=3, expert_cache="0.25", replay_routing=replay))
    reference = make().generate(prompts, GREEDY)
    engine = make()
    passes = _grouped(engine)
    out = engine.generate(prompts, GREEDY)
    assert [r.token_ids for r in out] == [r.token_ids for r in reference]
    assert len(passes) >= GREEDY.max_tokens - 1  # every decode pass of the three lanes
    tables = engine.offload.tables
    tables.check()
    assert tables.previous[1].any()  # the second group's own previous steps


def test_grouped_bypasses_take_their_groups_staging_rows(tmp_path: Path) -> None:
    """A frozen cache: every miss is a bypass, computed from a staging row, and the tokens are the
    reference's. (On the CPU the groups run one after the other: this checks the path; that the groups'
    bypasses take separate halves of the rows is test_cache_tables's.)"""
    path = make_model(tmp_path / "m", preset="tiny", arch="qwen3_moe", seed=1)
    prompts = _prompts()
    reference = Engine(WorkerConfig(str(path), max_running=3)).generate(prompts, GREEDY)
    engine = Engine(WorkerConfig(str(path), max_running=3, expert_cache="0.25"))
    engine.offload.tables.frozen = True
    passes = _grouped(engine)
    out = engine.generate(prompts, GREEDY)
    assert [r.token_ids for r in out] == [r.token_ids for r in reference]
    assert len(passes) >= GREEDY.max_tokens - 1
    counters = engine.offload.tables.counters
    assert int(counters["bypasses"].sum()) == int(counters["misses"].sum()) > 0


def test_grouped_passes_make_no_guesses(tmp_path: Path) -> None:
    """Lookahead is on, but a grouped pass guesses nothing (its update and stream are one group's at a time):
    every decode pass here is grouped, so no guess is made or copied."""
    path = make_model(tmp_path / "m", preset="tiny", arch="qwen3_moe", seed=1)
    prompts = _prompts()
    engine = Engine(WorkerConfig(str(path), max_running=3, expert_cache="0.25", lookahead=2))
    passes = _grouped(engine)
    engine.generate(prompts, GREEDY)
    assert len(passes) >= GREEDY.max_tokens - 1
    counters = engine.offload.tables.counters
    assert int(counters["guesses"].sum()) == int(counters["prefetches"].sum()) == 0


def test_an_untracked_pass_leaves_the_grouping_as_it_was(tmp_path: Path) -> None:
    """A warm-up (an eager pass: one group) between grouped passes puts the previous steps back, and with
    them their grouping."""
    path = make_model(tmp_path / "m", preset="tiny", arch="qwen3_moe", seed=1)
    engine = Engine(WorkerConfig(str(path), max_running=3, expert_cache="0.25"))
    tables = engine.offload.tables
    tables.regroup(2)
    tables.previous[1, 0, 3] = True
    before = tables.previous.clone()
    engine.runner.warm_up(tokens=4)  # untracked, its passes regroup to one
    assert tables.groups == 2 and torch.equal(tables.previous, before)
