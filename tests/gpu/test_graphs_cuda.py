"""Recorded decode passes (common/engine/graphs.py) against the same passes run op by op, on the GPU: the same
tokens, the same expert cache traffic (the recorded resolution reads the step, the routing replay's cursor
and the freeze flag from the device), lane counts recorded as they come, capacities moved between replays."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.kernels.config import KERNELS, KernelConfig
from common.model.fused_kernels import use_fused_kernels
from common.model.synthetic.checkpoint import make_model
from common.protocol import SamplingParams

# qwen4_exp with a small indexer budget: decode crosses from dense to selected keys
ARCHS = {"qwen3_moe": None, "qwen4_exp": {"indexer_budget": 8, "indexer_compress_ratio": 4}}
PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _run(
    path: Path, graphs: bool, cache: str | None, fused: bool = False, lookahead: int = 0, lanes: int = 2,
    kernels: KernelConfig = KERNELS,
) -> tuple[list[list[int]], Engine]:  # fmt: skip
    engine = Engine(
        WorkerConfig(
            str(path),
            device="cuda",
            max_running=lanes,
            expert_cache=cache,
            cuda_graphs=graphs,
            replay_routing="synthetic-zipf:seed=3" if cache else None,
            lookahead=lookahead,
            kernels=kernels,
        )
    )
    if cache is not None:
        engine.offload.rebalance_every = 8  # capacities move between replays
    use_fused_kernels(engine.model, fused, engine.runner.backend)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (6, 23, 15)]
    return [r.token_ids for r in engine.generate(prompts, PARAMS)], engine


@pytest.mark.parametrize(("cache", "fused"), [(None, False), ("0.25", False), ("0.25", True)])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_recorded_decode_matches_eager(tmp_path: Path, arch: str, cache: str | None, fused: bool) -> None:
    """`fused`: the recorded steps use the opt-in fused kernels — the cache resolution (bit-identical) and
    the Gated DeltaNet step (its fp32 rounding differs by ~1e-6: the greedy tokens of these fixed inputs stay
    the same; routing is replayed, so cache counters must match exactly)."""
    path = make_model(tmp_path / "m", preset="tiny", arch=arch, overrides=ARCHS[arch])
    eager, reference = _run(path, False, cache)
    graphed, engine = _run(path, True, cache, fused)
    assert graphed == eager
    assert set(engine.runner.graphs.recorded) == {1, 2}  # two lanes, then one when a request finished
    if cache is not None:
        engine.offload.tables.check()
        for name, counts in engine.offload.tables.counters.items():
            assert torch.equal(counts, reference.offload.tables.counters[name]), name
        assert engine.offload.tables.capacities == reference.offload.tables.capacities


@pytest.mark.parametrize("fused", [False, True])
def test_recorded_lookahead_matches_eager(tmp_path: Path, fused: bool) -> None:
    """Lookahead in recorded steps: its guesses and table updates on their own stream, its copies queued
    behind the misses'. The tokens are those of a run without it; without the fused kernels (the same torch
    ops recorded and eager) the cache counters, prefetches included, match the eager run's exactly."""
    path = make_model(tmp_path / "m", preset="tiny", arch="qwen4_exp", overrides=ARCHS["qwen4_exp"])
    plain, _ = _run(path, False, "0.25")
    eager, reference = _run(path, False, "0.25", lookahead=4)
    graphed, engine = _run(path, True, "0.25", fused, lookahead=4)
    assert graphed == eager == plain
    engine.offload.tables.check()
    counters = engine.offload.tables.counters
    assert 0 < int(counters["prefetch_hits"].sum()) <= int(counters["prefetches"].sum())
    if not fused:
        for name, counts in counters.items():
            assert torch.equal(counts, reference.offload.tables.counters[name]), name


@pytest.mark.parametrize("lanes", [2, 3])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_recorded_grouped_decode_matches_eager(tmp_path: Path, arch: str, fused: bool, lanes: int) -> None:
    """Passes of two or three lanes recorded as two groups (1 + 1, 2 + 1; common/model/groups.py): each
    group's layers on a stream of their own, resolving each layer in turn, one group's copies beside the
    other's compute (with two lanes, the third request then runs alone: one group, regrouped). The tokens are
    the eager run's; the tables stay consistent, each group with its own previous steps."""
    path = make_model(tmp_path / "m", preset="tiny", arch=arch, overrides=ARCHS[arch])
    eager, _ = _run(path, False, "0.25", lanes=lanes)
    graphed, engine = _run(path, True, "0.25", fused, lanes=lanes, kernels=replace(KERNELS, split_lanes=2))
    assert graphed == eager
    assert engine.runner.graphs.groups(lanes) == 2 and engine.runner.graphs.groups(1) == 1
    tables = engine.offload.tables
    tables.check()
    assert tables.previous[1].any()


def test_forgotten_recordings_record_again(tmp_path: Path) -> None:
    """After `forget` (bench.decode_offload --ablate between variants) the next batches record afresh and
    decode the same tokens."""
    path = make_model(tmp_path / "m", preset="tiny", arch="qwen4_exp", overrides=ARCHS["qwen4_exp"])
    first, engine = _run(path, True, None)
    engine.runner.graphs.forget()
    assert not engine.runner.graphs.recorded
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (6, 23, 15)]
    again = [r.token_ids for r in engine.generate(prompts, PARAMS)]
    assert again == first
    assert set(engine.runner.graphs.recorded) == {1, 2}


def test_recorded_decode_with_programmatic_launch_is_unchanged(tmp_path: Path) -> None:
    """The decode kernels launched with programmatic dependent launch (the default) in recorded steps
    (qwen4_exp, fused kernels): each waits for the kernels before it, so the tokens and the cache counters
    are those of the same recorded steps without it, exactly; so with the tails' kernels triggering as they
    start (KernelConfig.pdl_start_trigger, the default) and without, and with the trigger at every kernel's
    exit. (The int4 kernels: tests/gpu/test_offload_cuda.py.)"""
    path = make_model(tmp_path / "m", preset="tiny", arch="qwen4_exp", overrides=ARCHS["qwen4_exp"])
    plain, reference = _run(path, True, "0.25", fused=True, kernels=replace(KERNELS, pdl=False))
    launched, engine = _run(path, True, "0.25", fused=True)
    late_start = replace(KERNELS, pdl_start_trigger=False)  # the tails' kernels trigger after their wait
    late, late_engine = _run(path, True, "0.25", fused=True, kernels=late_start)
    exit_trigger = replace(
        late_start, pdl_early_trigger=False
    )  # each kernel lets the next launch at its exit
    at_exit, exit_engine = _run(path, True, "0.25", fused=True, kernels=exit_trigger)
    assert launched == plain and at_exit == plain and late == plain
    for name, counts in engine.offload.tables.counters.items():
        assert torch.equal(counts, reference.offload.tables.counters[name]), name
        assert torch.equal(exit_engine.offload.tables.counters[name], counts), name
        assert torch.equal(late_engine.offload.tables.counters[name], counts), name


@pytest.mark.parametrize("split", [False, True], ids=["one-group", "two-groups"])
@pytest.mark.parametrize("fused", [False, True])
def test_recorded_decode_after_images_matches_eager(tmp_path: Path, fused: bool, split: bool) -> None:
    """Two lanes, one after a prompt with an image (its tokens rotate at position + delta: the recording's
    static `position_pair` carries both rows; with `split`, each lane a group of its own, whose batch views
    columns of it), one after text: recorded steps give the eager steps' tokens."""
    kernels = replace(KERNELS, split_lanes=2 if split else 0)
    from common.kv.state import PromptImages
    from common.model.qwen4_exp.positions import mrope_positions

    path = make_model(tmp_path / "m", preset="tiny", arch="qwen4_exp", overrides=ARCHS["qwen4_exp"])
    g = torch.Generator().manual_seed(1)
    image = 1022  # the tiny config's image token
    with_image = [*torch.randint(3, 1000, (5,), generator=g).tolist(), *[image] * 12]
    with_image += torch.randint(3, 1000, (6,), generator=g).tolist()
    text = torch.randint(3, 1000, (9,), generator=g).tolist()
    mrope, delta = mrope_positions(with_image, image, [(1, 4, 12)], 2)
    embeds = torch.randn(12, 64, generator=g)

    def decode(graphs: bool) -> list[list[int]]:
        cfg = WorkerConfig(str(path), device="cuda", max_running=2, cuda_graphs=graphs, kernels=kernels)
        engine = Engine(cfg)
        use_fused_kernels(engine.model, fused, engine.runner.backend)
        runner = engine.runner
        seqs = [runner.new_sequence(), runner.new_sequence()]
        seqs[0].images = PromptImages(torch.arange(5, 17), embeds.cuda(), mrope)
        seqs[0].rope_delta = delta
        first = [
            int(runner.forward([s], [p])[-1].argmax()) for s, p in zip(seqs, (with_image, text), strict=True)
        ]
        seqs[0].images = None
        tokens = [[t] for t in first]
        for _ in range(12):
            logits = runner.forward(seqs, [[t[-1]] for t in tokens])
            for t, row in zip(tokens, logits, strict=True):
                t.append(int(row.argmax()))
        return tokens

    assert decode(True) == decode(False)
