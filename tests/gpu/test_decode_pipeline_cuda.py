"""Recorded decode passes launched a pass ahead of the host (common/engine/decode_pipeline.py), on the GPU:
the tokens of the engine's steps (the host reading each one's tokens before the next), and no launch after the
recordings waits for the device — torch's sync debug mode raises on any host wait inside one —, the
log-probabilities asked of every pass included."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from common.config import WorkerConfig
from common.engine.decode_pipeline import DecodePipeline
from common.engine.engine import Engine
from common.model.synthetic.checkpoint import make_model

STEPS = 30


def _engine(path: Path, cache: str | None) -> Engine:
    engine = Engine(
        WorkerConfig(
            str(path),
            device="cuda",
            max_running=2,
            expert_cache=cache,
            lookahead=0,
            replay_routing="synthetic-zipf:seed=3" if cache else None,
        )
    )
    if cache is not None:
        engine.offload.rebalance_every = 1000  # a rebalance reads the statistics: not in these steps
    return engine


def _prefilled(engine: Engine) -> tuple[list, list[int]]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (6, 23)]
    seqs = [engine.runner.new_sequence() for _ in prompts]
    firsts = [int(engine.runner.forward([s], [p]).argmax(-1)) for s, p in zip(seqs, prompts, strict=True)]
    return seqs, firsts


@pytest.mark.parametrize("cache", [None, "0.25"], ids=["resident", "offloaded"])
def test_pipelined_recorded_steps_run_ahead_of_the_host(tmp_path: Path, cache: str | None) -> None:
    path = make_model(tmp_path / "m", preset="tiny", arch="qwen4_exp", overrides={"indexer_budget": 8})
    engine = _engine(path, cache)
    seqs, tokens = _prefilled(engine)
    want = [[t] for t in tokens]
    for _ in range(STEPS):  # the host reads each step's tokens before it builds the next
        tokens = engine.runner.forward(seqs, [[t] for t in tokens]).argmax(-1).tolist()
        for row, t in zip(want, tokens, strict=True):
            row.append(t)

    engine = _engine(path, cache)
    seqs, firsts = _prefilled(engine)
    pipe = DecodePipeline(engine.runner)
    pipe.seed(seqs, firsts)
    got = [[t] for t in firsts]

    def land() -> None:
        lanes, tokens, (chosen, values, ids) = pipe.land()
        for lane, t in zip(lanes, tokens, strict=True):
            got[lane].append(t)
        assert ids[:, 0].tolist() == tokens and torch.equal(chosen, values[:, 0])  # greedy: the best
        assert (values[:, :1] >= values[:, 1:]).all() and (values <= 0).all()

    for step in range(STEPS):
        if len(pipe.launched) == pipe.depth:
            land()
        torch.cuda.set_sync_debug_mode("error" if step else "default")  # the first pass records its graph
        try:
            pipe.launch([0, 1], seqs, lambda logits: logits.argmax(dim=-1), top=2)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    while pipe.launched:
        land()
    assert got == want
    assert set(engine.runner.graphs.recorded) == {2}
    if cache is not None:
        engine.offload.tables.check()


def test_a_pass_asked_for_logprobs_returns_before_the_device_is_done(tmp_path: Path) -> None:
    """With ~0.1 s of device work queued ahead of it, a launch that asks for logprobs returns at once and its
    pass is not done yet: nothing in it waits for the stream (a strided pinned destination would)."""
    path = make_model(tmp_path / "m", preset="tiny", arch="qwen4_exp")
    engine = _engine(path, None)
    seqs, firsts = _prefilled(engine)
    pipe = DecodePipeline(engine.runner)
    pipe.seed(seqs, firsts)
    greedy = lambda logits: logits.argmax(dim=-1)
    pipe.launch([0, 1], seqs, greedy, top=3)  # records the graph, makes the buffers
    pipe.land()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of a busy device
    started = time.perf_counter()
    pipe.launch([0, 1], seqs, greedy, top=3)
    took = time.perf_counter() - started
    assert took < 0.05 and not pipe.launched[-1].done.query()
    _, tokens, (chosen, values, ids) = pipe.land()
    assert ids[:, 0].tolist() == tokens and torch.equal(chosen, values[:, 0])
