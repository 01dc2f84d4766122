"""The offline engine: continuous batching, stop conditions, seeded sampling."""

from __future__ import annotations

import pytest

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.model.synthetic.checkpoint import make_model
from common.protocol import SamplingParams


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    model_dir = make_model(tmp_path_factory.mktemp("tiny"), preset="tiny", arch="qwen2_moe")
    return Engine(WorkerConfig(str(model_dir), max_running=3, max_context=96))


PROMPTS = [[5, 6, 7, 8], [100, 200, 300, 400, 500, 600, 700], [42], [9, 9, 9, 9, 9]]


def test_batched_equals_alone(engine: Engine) -> None:
    """Four prompts through three lanes, finishing at different steps, give what each gives alone."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 12, 7, 9)]
    together = engine.generate(PROMPTS, params)
    for prompt, p, got in zip(PROMPTS, params, together, strict=True):
        alone = engine.generate([prompt], p)[0]
        assert got.token_ids == alone.token_ids
        assert len(got.token_ids) == p.max_tokens and got.finish_reason == "length"
    assert engine.runner.pool.pages.num_free == engine.runner.pool.pages.size  # everything released
    assert engine.runner.pool.slots.num_free == 3


def test_stop_token_ends_request(engine: Engine) -> None:
    greedy = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    stop_at = greedy.token_ids[2]
    first = greedy.token_ids.index(stop_at)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=(stop_at,))
    result = engine.generate([PROMPTS[0]], params)[0]
    assert result.token_ids == greedy.token_ids[: first + 1] and result.finish_reason == "stop"


def test_eos_stops_unless_ignored(engine: Engine) -> None:
    eos = engine.config.eos_token_ids
    assert 2 in eos  # <|im_end|> of the synthetic tokenizer
    result = engine.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=40))[0]
    if result.finish_reason == "stop":
        assert result.token_ids[-1] in eos
    assert all(t not in eos for t in result.token_ids[:-1])


def test_seeded_sampling_is_reproducible_in_any_batch(engine: Engine) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    alone = engine.generate([PROMPTS[1]], params)[0].token_ids
    other = SamplingParams(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True)
    batched = engine.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [other, params, other])[1].token_ids
    assert alone == batched
    different = SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_tokens=10, ignore_eos=True)
    assert engine.generate([PROMPTS[1]], different)[0].token_ids != alone


def test_context_limit(engine: Engine) -> None:
    prompt = list(range(3, 93))  # 90 tokens of a 96-token context
    result = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))[0]
    assert result.finish_reason == "length" and len(result.token_ids) == 96 - 90
    with pytest.raises(ValueError, match="exceeds the context"):
        engine.generate([list(range(3, 103))], SamplingParams(max_tokens=1))


def test_running_requests_decode_between_a_long_prompts_chunks(tmp_path) -> None:
    """A prompt prefilled in chunks while another request runs: the running one takes a decode step between
    the chunks (it is not stalled for the whole prompt), and every output is what it is alone."""
    model_dir = make_model(tmp_path / "m", preset="tiny", arch="qwen2_moe")
    engine = Engine(
        WorkerConfig(str(model_dir), max_running=2, max_context=96, prefill_chunk=8, layer_major_tokens=0)
    )
    prompts = [[5, 6, 7], [11, 12, 13, 14], list(range(20, 60))]  # the third: 40 tokens, 5 chunks
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (2, 12, 3)]
    passes: list[list[int]] = []  # tokens per sequence of each pass
    forward = engine.runner.forward

    def logged(seqs, tokens):
        passes.append([len(t) for t in tokens])
        return forward(seqs, tokens)

    engine.runner.forward = logged
    together = engine.generate(prompts, params)
    chunks = [i for i, p in enumerate(passes) if p == [8]]  # the long prompt's passes (alone in them)
    assert len(chunks) == 5
    assert all(passes[a + 1] == [1] for a in chunks[:-1])  # a decode step after each chunk but the last
    engine.runner.forward = forward
    for prompt, p, got in zip(prompts, params, together, strict=True):
        assert got.token_ids == engine.generate([prompt], p)[0].token_ids


def test_a_long_prompt_goes_layer_major_in_groups(tmp_path) -> None:
    """A 40-token prompt in chunks of 8 and layer-major groups of 16 while another request runs: three
    layer-major passes (16, 16, 8 tokens) with a decode step of the running request between them, and the
    tokens of chunk-by-chunk passes."""
    model_dir = make_model(tmp_path / "m", preset="tiny", arch="qwen3_moe")
    make = lambda group: Engine(
        WorkerConfig(
            str(model_dir),
            max_running=2,
            max_context=96,
            prefill_chunk=8,
            expert_cache="0.5",
            layer_major_tokens=group,
        )
    )
    engine = make(16)
    prompts = [[5, 6, 7], [11, 12, 13, 14], list(range(20, 60))]  # the third waits for the first's lane
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (2, 12, 3)]
    passes: list[tuple[str, list[int]]] = []
    forward, layer_major = engine.runner.forward, engine.runner.prefill_layer_major

    def logged_forward(seqs, tokens):
        passes.append(("pass", [len(t) for t in tokens]))
        return forward(seqs, tokens)

    def logged_layer_major(seq, tokens, chunk, kv_bound=None):
        assert chunk == 8 and kv_bound == 40  # every group's buffers sized for the whole prompt
        passes.append(("layer-major", [len(tokens)]))
        return layer_major(seq, tokens, chunk, kv_bound)

    engine.runner.forward, engine.runner.prefill_layer_major = logged_forward, logged_layer_major
    together = engine.generate(prompts, params)
    groups = [i for i, p in enumerate(passes) if p[0] == "layer-major"]
    assert [passes[i][1] for i in groups] == [[16], [16], [8]]
    assert all(passes[i + 1] == ("pass", [1]) for i in groups[:-1])  # the running request's decode share
    chunked = make(0).generate(prompts, params)
    assert [r.token_ids for r in together] == [r.token_ids for r in chunked]


def test_pool_bytes_measure_what_the_engine_holds(tmp_path) -> None:
    """Without a memory plan the pools are measured: the weights and the state pool; offloaded, the cache's
    slots and the other expert rows, which together are the expert pool."""
    model_dir = make_model(tmp_path / "m", preset="tiny", arch="qwen3_moe")
    resident = Engine(WorkerConfig(str(model_dir))).pool_bytes()
    assert set(resident) == {"weights", "kv"} and min(resident.values()) > 0
    engine = Engine(WorkerConfig(str(model_dir), expert_cache="0.5"))
    pools = engine.pool_bytes()
    offload = engine.offload
    assert offload is not None
    assert pools["expert_cache"] == offload.tables.num_slots * offload.store.expert_bytes > 0
    assert pools["expert_cache"] + pools["arena"] == sum(t.nbytes for t in offload.pool.values())
    assert pools["weights"] < resident["weights"], "the routed experts are not resident"
