"""Sampling options end to end, `spillway serve` (router, prefill and decode as separate processes) asked
through the official `openai` client.

Log-probabilities: for each generated token, what transformers' forward pass over the same tokens gives (the
chosen token's log-softmax and the best alternatives'), the first token's from prefill and the rest from
decode's pipelined steps, for a greedy and a sampled request alike (the model's own distribution, before
temperature). Penalties, logit biases, min_p and min_tokens: the tokens `Engine.generate` samples offline.
"""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest
import torch

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.model.synthetic.checkpoint import make_model
from common.protocol import SamplingParams
from common.sampling.structured import structure_of
from tests.conftest import Server, free_port, wait_healthy

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 300, 42, 9, 77, 120, 3]
TOKENS = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("q3") / "tiny", "tiny", "qwen3_moe", {"torch_dtype": "float32"})


@pytest.fixture(scope="module")
def server(model):
    port = free_port()
    args = ["--model", str(model), "--dtype", "float32", "--threads", "1", "--max-context", "512"]
    served = Server(
        subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--port", str(port), *args]), port
    )
    try:
        wait_healthy(port)
        yield served
    finally:
        served.stop()


def _reference(model, ids: list[int]) -> torch.Tensor:
    """transformers' log-probabilities [len(ids) - len(PROMPT), V] at each generated position."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + ids])).logits[0].float()  # [T, V]
    return torch.log_softmax(logits[len(PROMPT) - 1 : -1], dim=-1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_served_logprobs_are_transformers_log_softmax(server, model, temperature: float) -> None:
    out = server.client().completions.create(
        model=model.name, prompt=PROMPT, max_tokens=TOKENS, logprobs=3, temperature=temperature, seed=11,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == TOKENS == out.usage.completion_tokens
    ids = [int(t.removeprefix("token_id:")) for t in lp.tokens]
    want = _reference(model, ids)  # [TOKENS, V]
    got = torch.tensor(lp.token_logprobs)
    torch.testing.assert_close(got, want[torch.arange(TOKENS), torch.tensor(ids)], atol=2e-4, rtol=0)
    best, best_ids = want.topk(3, dim=-1)
    for top, values, alternatives, token in zip(lp.top_logprobs, best, best_ids, lp.tokens, strict=True):
        want_top = {f"token_id:{i}": float(v) for i, v in zip(alternatives.tolist(), values, strict=True)}
        assert set(top) == set(want_top) | {token}
        for piece, value in want_top.items():
            assert abs(top[piece] - value) < 2e-4
    if temperature == 0:
        assert ids == best_ids[:, 0].tolist()
    stream = server.client().chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=TOKENS, stream=True,
        logprobs=True, top_logprobs=2, temperature=temperature, seed=11,
    )  # fmt: skip
    entries = [
        e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert 1 <= len(entries) <= TOKENS and all(len(e.top_logprobs) == 2 for e in entries)
    assert all(e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in entries)


LONG = 16
"""Tokens of the penalty cases: the tiny model's greedy answer to PROMPT repeats itself at the 14th."""
CASES = [
    (
        {"temperature": 0.0, "frequency_penalty": 2.0, "presence_penalty": 2.0},
        {},
        SamplingParams(temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0),
    ),
    (
        {"temperature": 0.0},
        {"repetition_penalty": 3.0},
        SamplingParams(temperature=0.0, repetition_penalty=3.0),
    ),
    (
        {"temperature": 0.8, "seed": 5, "logit_bias": {"1015": -100}},
        {"min_p": 0.05, "min_tokens": LONG},
        SamplingParams(temperature=0.8, seed=5, min_p=0.05, min_tokens=LONG, logit_bias=((1015, -100.0),)),
    ),
]


@pytest.mark.parametrize(
    ("fields", "extensions", "params"), CASES, ids=["presence-frequency", "repetition", "bias-min"]
)
def test_penalties_biases_and_min_tokens_sample_what_the_engine_samples(
    server, model, fields: dict, extensions: dict, params: SamplingParams
) -> None:
    """The served tokens are the engine's for the same options, and not those it samples without them."""
    out = server.client().completions.create(
        model=model.name, prompt=PROMPT, max_tokens=LONG, logprobs=0,
        extra_body={**extensions, "return_tokens_as_token_ids": True}, **fields,
    )  # fmt: skip
    ids = [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]
    engine = Engine(WorkerConfig(str(model), max_running=1))
    want = engine.generate([PROMPT], msgspec.structs.replace(params, max_tokens=LONG))[0].token_ids
    plain = SamplingParams(temperature=params.temperature, seed=params.seed, max_tokens=LONG)
    assert ids == want and want != engine.generate([PROMPT], plain)[0].token_ids


def test_seeded_choices_are_the_engines_with_seeds_in_turn(server, model) -> None:
    """n = 3 at seed 21: choice i is what the engine samples at seed 21 + i."""
    out = server.client().completions.create(
        model=model.name, prompt=PROMPT, max_tokens=TOKENS, n=3, temperature=1.0, seed=21, logprobs=0,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    got = [[int(t.removeprefix("token_id:")) for t in c.logprobs.tokens] for c in out.choices]
    engine = Engine(WorkerConfig(str(model), max_running=3))
    params = [
        SamplingParams(temperature=1.0, seed=21 + i, max_tokens=TOKENS, ignore_eos=True) for i in range(3)
    ]
    assert got == [r.token_ids for r in engine.generate([PROMPT] * 3, params)]
    assert len({tuple(g) for g in got}) == 3


def test_a_json_schema_is_followed(server, model) -> None:
    """response_format json_schema: the served text is the engine's under the same grammar, a JSON object
    of the schema, ended by the model's end-of-sequence token."""
    schema = {
        "type": "object",
        "properties": {"size": {"enum": ["S", "M", "L"]}, "count": {"enum": [1, 2, 3]}},
        "required": ["size", "count"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": schema}}
    out = server.client().chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": "Order?"}], response_format=fmt,
        temperature=0.7, seed=3, max_tokens=40,
    )  # fmt: skip
    value = json.loads(out.choices[0].message.content)
    assert out.choices[0].finish_reason == "stop" and value["size"] in "SML" and value["count"] in (1, 2, 3)
    engine = Engine(WorkerConfig(str(model), max_running=1))
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Order?"}], tokenize=True)
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=40, structure=structure_of(fmt))
    assert out.choices[0].message.content == engine.tokenizer.decode(
        engine.generate([prompt], params)[0].token_ids
    )


def test_an_echoed_prompt_has_transformers_logprobs(server, model) -> None:
    out = server.client().completions.create(
        model=model.name, prompt=PROMPT, max_tokens=1, echo=True, logprobs=1,
        extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    lp = out.choices[0].logprobs
    assert lp.tokens[: len(PROMPT)] == [f"token_id:{t}" for t in PROMPT] and lp.token_logprobs[0] is None
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].float(), dim=-1)  # [T, V]
    got = torch.tensor(lp.token_logprobs[1 : len(PROMPT)])
    torch.testing.assert_close(
        got, want[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])], atol=2e-4, rtol=0
    )


def test_a_named_tool_choice_answers_with_that_call(server, model) -> None:
    """tool_choice naming a function: the served model's answer is one call of it (arguments of its
    schema), whatever the random weights would have said, with finish reason tool_calls."""
    params = {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"]}
    tools = [
        {"type": "function", "function": {"name": "weather", "parameters": params}},
        {
            "type": "function",
            "function": {"name": "time", "parameters": {"type": "object", "properties": {}}},
        },
    ]
    out = server.client().chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": "Weather?"}], tools=tools, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "weather"}}, temperature=1.0, seed=1,
    )  # fmt: skip
    choice = out.choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "weather" and json.loads(call.function.arguments)["unit"] in ("C", "F")
    assert choice.finish_reason == "tool_calls" and not choice.message.content
