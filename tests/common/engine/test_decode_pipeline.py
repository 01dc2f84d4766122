"""DecodePipeline: passes launched one ahead of the host read their tokens on the device, and decode what
passes that take turns with the host decode, lanes joining and leaving included."""

from __future__ import annotations

import pytest
import torch

from common.config import WorkerConfig
from common.engine.decode_pipeline import DecodePipeline
from common.engine.engine import Engine
from common.model.defaults import default_model_dir

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 3, 100, 3]]


def greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(WorkerConfig(str(default_model_dir()), max_running=3))


def _prefilled(engine: Engine, prompts: list[list[int]]) -> tuple[list, list[int]]:
    runner = engine.runner
    seqs = [runner.new_sequence() for _ in prompts]
    firsts = [int(runner.forward([s], [p]).argmax(-1)) for s, p in zip(seqs, prompts, strict=True)]
    return seqs, firsts


def _reference(engine: Engine, steps: int) -> list[list[int]]:
    """Each prompt's greedy tokens, the host reading every step's before the next."""
    seqs, tokens = _prefilled(engine, PROMPTS)
    out = [[t] for t in tokens]
    for _ in range(steps):
        tokens = engine.runner.forward(seqs, [[t] for t in tokens]).argmax(-1).tolist()
        for row, t in zip(out, tokens, strict=True):
            row.append(t)
    for s in seqs:
        engine.runner.release(s)
    return out


def test_pipelined_steps_decode_what_alternating_steps_do(engine: Engine) -> None:
    want = _reference(engine, 6)
    seqs, firsts = _prefilled(engine, PROMPTS)
    pipe = DecodePipeline(engine.runner)
    pipe.seed(seqs, firsts)
    got = [[t] for t in firsts]
    for _ in range(6):
        if len(pipe.launched) == pipe.depth:
            lanes, tokens, _ = pipe.land()
            for lane, t in zip(lanes, tokens, strict=True):
                got[lane].append(t)
        pipe.launch([0, 1, 2], seqs, greedy)
        assert all(pipe.uses(s) for s in seqs) and pipe.ahead(1)
    assert len(pipe.launched) == 2  # the host is a step behind
    while pipe.launched:
        lanes, tokens, _ = pipe.land()
        for lane, t in zip(lanes, tokens, strict=True):
            got[lane].append(t)
    assert got == want
    assert not pipe.uses(seqs[0]) and not pipe.ahead(0) and pipe.land() is None
    assert [s.num_cached for s in seqs] == [len(p) + 6 for p in PROMPTS]
    assert pipe.newest[[s.slot for s in seqs]].tolist() == [row[-1] for row in want]
    for s in seqs:
        engine.runner.release(s)


def test_lanes_join_and_leave_between_launches(engine: Engine) -> None:
    """Lane 2 joins at the third step (its first token from the host), lane 0 leaves after the fourth:
    each lane's tokens are still its own greedy decode."""
    want = _reference(engine, 6)
    seqs, firsts = _prefilled(engine, PROMPTS)
    pipe = DecodePipeline(engine.runner)
    pipe.seed(seqs[:2], firsts[:2])
    got = [[t] for t in firsts]
    plan = [[0, 1], [0, 1], [0, 1, 2], [0, 1, 2], [1, 2], [1, 2], [2], [2]]
    for step, lanes in enumerate(plan):
        if step == 2:
            pipe.seed([seqs[2]], [firsts[2]])
        if len(pipe.launched) == pipe.depth:
            for lane, t in zip(*pipe.land()[:2], strict=True):
                got[lane].append(t)
        pipe.launch(lanes, [seqs[i] for i in lanes], greedy)
    while pipe.launched:
        for lane, t in zip(*pipe.land()[:2], strict=True):
            got[lane].append(t)
    assert got[0] == want[0][:5] and got[1] == want[1][:7] and got[2] == want[2][:7]
    for s in seqs:
        engine.runner.release(s)


def test_a_pass_asked_for_logprobs_lands_the_models_log_softmax(engine: Engine) -> None:
    """`top`: the chosen tokens' log-probabilities and the `top` best, as the same pass's logits give them;
    a pass that asks for none lands none."""
    seqs, firsts = _prefilled(engine, PROMPTS)
    want = torch.log_softmax(engine.runner.forward(seqs, [[t] for t in firsts]).float(), dim=-1)  # [3, V]
    for s in seqs:
        engine.runner.release(s)
    seqs, firsts = _prefilled(engine, PROMPTS)
    pipe = DecodePipeline(engine.runner)
    pipe.seed(seqs, firsts)
    pipe.launch([0, 1, 2], seqs, greedy, top=3)
    pipe.launch([0, 1, 2], seqs, greedy)
    lanes, tokens, (chosen, values, ids) = pipe.land()
    assert lanes == [0, 1, 2]
    best, best_ids = want.topk(3, dim=-1)
    assert tokens == best_ids[:, 0].tolist()
    torch.testing.assert_close(chosen, want.gather(1, torch.tensor(tokens)[:, None]).squeeze(1))
    torch.testing.assert_close(values, best)
    assert torch.equal(ids, best_ids)
    assert pipe.land().logprobs is None
    for s in seqs:
        engine.runner.release(s)
