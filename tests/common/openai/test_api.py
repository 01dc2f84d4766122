"""OpenAI request validation and the internal form (prompt ids, SamplingParams, stop strings)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import tokenizers

from common.model.defaults import default_model_dir
from common.openai import api
from common.openai import prompts as openai_prompts
from common.openai.api import COMPLETION_MAX_TOKENS, ApiError
from common.openai.tool_calls import tool_call_tags
from common.protocol import SamplingParams
from common.text.tokenizer import Tokenizer

CONTEXT = 64
USER = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir())


def chat(tok: Tokenizer, **body: Any) -> api.GenerationSpec:
    """As the router reads a chat: its tools, its prompt, its spec."""
    request = api.parse_chat_request(json.dumps({"model": "m", "messages": USER, **body}).encode())
    tools = openai_prompts.chat_tools(request, tool_call_tags(tok))
    return api.chat_spec(
        request, openai_prompts.chat_prompt_ids(request, tok, None, tools)[0], CONTEXT, tok.vocab_size
    )


def completions(tok: Tokenizer, **body: Any) -> list[api.GenerationSpec]:
    """As the router reads a text completion: a spec for each of its prompts."""
    request = api.parse_completion_request(json.dumps({"model": "m", **body}).encode())
    return api.completion_specs(request, openai_prompts.completion_prompts(request, tok), CONTEXT, tok)


def completion(tok: Tokenizer, **body: Any) -> api.GenerationSpec:
    (spec,) = completions(tok, **body)
    return spec


def refused(fn: Any, *args: Any, **kwargs: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args, **kwargs)
    body = info.value.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    return info.value


def test_chat_defaults(tok: Tokenizer) -> None:
    spec = chat(tok)
    want = tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=True)
    assert spec.prompt_ids == want
    room = CONTEXT - len(want)
    assert spec.sampling == SamplingParams(temperature=1.0, top_p=1.0, top_k=0, seed=None, max_tokens=room)
    assert spec.stop == () and not spec.stream and not spec.include_usage


def test_chat_parameters(tok: Tokenizer) -> None:
    spec = chat(
        tok,
        max_tokens=3,
        temperature=0,
        top_p=0.5,
        top_k=-1,
        seed=7,
        stop="END",
        ignore_eos=True,
        stop_token_ids=[5],
        stream=True,
        stream_options={"include_usage": True},
        some_future_field={"ignored": True},
    )
    assert spec.sampling == SamplingParams(0.0, 0.5, 0, 7, 3, True, (5,))
    assert spec.stop == ("END",) and spec.stream and spec.include_usage


def test_a_batch_of_prompts_is_a_spec_each(tok: Tokenizer) -> None:
    specs = completions(tok, prompt=["Hello", [300, 301]], echo=True, n=2)
    assert [s.prompt_ids for s in specs] == [tok.encode("Hello", add_special_tokens=True), [300, 301]]
    assert [s.echo for s in specs] == ["Hello", tok.decode([300, 301])] and all(s.n == 2 for s in specs)
    err = refused(completions, tok, prompt=["fine", [1 << 20]])
    assert err.body()["error"]["param"] == "prompt[1]"


def test_echo_asks_for_the_prompts_logprobs_too(tok: Tokenizer) -> None:
    spec = completion(tok, prompt="Hello there", echo=True, logprobs=2)
    assert spec.echo == "Hello there" and spec.sampling.prompt_logprobs == spec.sampling.logprobs == 2
    assert completion(tok, prompt=[[300, 301]], echo=True).echo == tok.decode([300, 301])
    assert completion(tok, prompt="x", echo=True).sampling.prompt_logprobs is None
    assert completion(tok, prompt="x").echo is None


def test_logprobs_ask_for_the_token_and_its_alternatives(tok: Tokenizer) -> None:
    assert chat(tok, logprobs=True).sampling.logprobs == 0
    assert chat(tok, logprobs=True, top_logprobs=20).sampling.logprobs == 20
    assert chat(tok, logprobs=False).sampling.logprobs is None
    assert completion(tok, prompt="x", logprobs=0).sampling.logprobs == 0
    assert completion(tok, prompt="x", logprobs=5).sampling.logprobs == 5
    assert completion(tok, prompt="x").sampling.logprobs is None


def test_nulls_read_as_openai_reads_them(tok: Tokenizer) -> None:
    spec = chat(tok, stream=None, ignore_eos=None, top_p=0)
    assert not spec.stream and not spec.sampling.ignore_eos and spec.sampling.top_p == 0.0
    assert chat(tok, stream=True, stream_options={"include_usage": None}).include_usage is False


def test_max_completion_tokens_wins_and_no_limit_runs_to_the_context(tok: Tokenizer) -> None:
    assert chat(tok, max_tokens=3, max_completion_tokens=5).sampling.max_tokens == 5
    spec = chat(tok)
    assert spec.sampling.max_tokens == CONTEXT - len(spec.prompt_ids)
    room = CONTEXT - len(chat(tok).prompt_ids)
    assert chat(tok, max_tokens=room).sampling.max_tokens == room


@pytest.mark.parametrize("value", [10_000, 10**9, 2**70])
@pytest.mark.parametrize("param", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_past_the_context_is_a_400(tok: Tokenizer, param: str, value: int) -> None:
    """vLLM's rule: prompt + max_tokens over the context is refused, not clamped (nor held to the end)."""
    room = CONTEXT - len(chat(tok).prompt_ids)
    err = refused(chat, tok, **{param: room + 1 if value == 10_000 else value})
    assert err.status == 400 and err.param == param and err.code == "context_length_exceeded"
    assert str(room) in err.message
    err = refused(completion, tok, prompt="x", max_tokens=value)
    assert err.status == 400 and err.param == "max_tokens"


def test_a_completion_without_max_tokens_stops_at_the_default_or_the_context(tok: Tokenizer) -> None:
    assert completion(tok, prompt="x").sampling.max_tokens == COMPLETION_MAX_TOKENS
    assert completion(tok, prompt=[5] * (CONTEXT - 5)).sampling.max_tokens == 5


def test_prompt_longer_than_context_names_both_numbers(tok: Tokenizer) -> None:
    text = "word " * 100
    n = len(tok.encode(text))
    err = refused(completion, tok, prompt=text)
    assert err.status == 400 and err.code == "context_length_exceeded"
    assert str(n) in err.message and str(CONTEXT) in err.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"temperature": "1"}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": -0.1}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 17}, "n"),
        ({"n": 0}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"seed": 1 << 64}, "seed"),
        ({"stream": "yes"}, "stream"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, None),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"chat_template_kwargs": {"chat_template": "{{ 7 * 7 }}"}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"self": 1}}, "chat_template_kwargs"),
        ({"top_k": 1 << 63}, "top_k"),
        ({"stop_token_ids": [1 << 63]}, "stop_token_ids"),
        ({"stop_token_ids": [5, 1 << 20]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": 1e39}, "repetition_penalty"),
        ({"repetition_penalty": 0.001}, "repetition_penalty"),
        ({"logit_bias": {"05": 1}}, "logit_bias"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {str(1 << 20): 1}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
        ({"tools": [{"type": "function", "function": {"name": 5}}]}, "tools[0]"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
    ],
)
def test_chat_refusals(tok: Tokenizer, body: dict[str, Any], param: str | None) -> None:
    err = refused(chat, tok, **body)
    assert err.status == 400 and err.type == "invalid_request_error"
    if param is not None:
        assert err.param == param, err.message


def test_image_parts_name_their_position(tok: Tokenizer) -> None:
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    err = refused(chat, tok, messages=[{"role": "user", "content": parts}])
    assert err.param == "messages[0].content[1]"


def test_malformed_bodies() -> None:
    for body in (b"{not json", b"[1, 2]", b""):
        err = refused(api.parse_chat_request, body)
        assert err.status == 400 and err.code == "invalid_json"
    err = refused(api.parse_chat_request, b'{"model": "m"}')
    assert err.param == "messages" and "required" in err.message


def test_chat_template_kwargs_reach_the_template(tok: Tokenizer) -> None:
    assert chat(tok, chat_template_kwargs={"enable_thinking": False}).prompt_ids == chat(tok).prompt_ids


def test_text_parts_and_developer_role(tok: Tokenizer) -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
    ]
    spec = chat(tok, messages=messages)
    want = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert spec.prompt_ids == tok.apply_chat_template(want, tokenize=True)


def test_neutral_values_of_unsupported_fields_are_accepted(tok: Tokenizer) -> None:
    neutral = {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "n": 1}
    assert chat(tok, **neutral).sampling == chat(tok).sampling
    assert chat(tok, top_k=(1 << 63) - 1).sampling.top_k == (1 << 63) - 1  # keeps every token


def test_a_response_format_is_a_schema_to_follow(tok: Tokenizer) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = chat(tok, response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    assert json.loads(spec.sampling.structure) == {"schema": schema}
    assert chat(tok, response_format={"type": "text"}).sampling.structure == ""


def test_penalties_biases_and_min_tokens_reach_the_sampling(tok: Tokenizer) -> None:
    spec = chat(
        tok,
        presence_penalty=0.5,
        frequency_penalty=-1,
        repetition_penalty=1.3,
        min_p=0.05,
        min_tokens=3,
        max_tokens=3,
        logit_bias={"7": -100, "12": 2.5},
    )
    s = spec.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p) == (0.5, -1.0, 1.3, 0.05)
    assert s.min_tokens == 3 and s.logit_bias == ((7, -100.0), (12, 2.5)) and s.penalized
    assert not chat(tok, presence_penalty=0, repetition_penalty=1).sampling.penalized


def plain_template(source: str) -> Tokenizer:
    """The tiny model's tokenizer with the chat template `source`."""
    backend = tokenizers.Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
    return Tokenizer(backend, chat_template=source)


def test_text_parts_reach_a_string_template_as_one_string() -> None:
    tok = plain_template("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    parts = [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]
    assert chat(tok, messages=[{"role": "user", "content": parts}]).prompt_ids == tok.encode("[Hi there]")


def test_a_template_error_of_any_kind_is_a_400() -> None:
    """A template may trip over a client's values with any exception (here jinja's TypeError on `tools`)."""
    source = "{% for t in tools %}{{ t }}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    err = refused(chat, plain_template(source), chat_template_kwargs={"tools": 5})
    assert err.param == "messages" and "TypeError" in err.message


def test_completion_prompt_forms(tok: Tokenizer) -> None:
    ids = tok.encode("Once upon a time")
    assert completion(tok, prompt="Once upon a time").prompt_ids == ids
    assert completion(tok, prompt=ids).prompt_ids == ids
    assert completion(tok, prompt=["Once upon a time"]).prompt_ids == ids
    assert completion(tok, prompt=[ids]).prompt_ids == ids


@pytest.mark.parametrize(
    ("prompt", "extra"),
    [
        ([[]], {}),
        (["x"] * 65, {}),
        ([1, 1 << 20], {}),
        ([-1], {}),
        ("", {}),
        ([], {}),
        (5, {}),
        ("x", {"best_of": 2}),
        ("x", {"suffix": "y"}),
        ("x", {"logprobs": 21}),
        ("x", {"logprobs": -1}),
        ("x", {"min_p": -0.5}),
    ],
)
def test_completion_refusals(tok: Tokenizer, prompt: Any, extra: dict[str, Any]) -> None:
    err = refused(completion, tok, prompt=prompt, **extra)
    assert err.status == 400


def test_stop_strings_are_deduplicated_and_empty_ones_dropped() -> None:
    assert api.parse_stop(["a", "", "a", "b"]) == ("a", "b")
    assert api.parse_stop("") == ()
    assert api.parse_stop(None) == ()


def test_unknown_model_is_404() -> None:
    api.check_model(None, "tiny")
    api.check_model("tiny", "tiny")
    err = refused(api.check_model, "gpt-4", "tiny")
    assert err.status == 404 and err.param == "model" and "gpt-4" in err.message


def test_tools_need_a_template_with_a_form_of_call(tok: Tokenizer) -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    request = api.parse_chat_request(json.dumps({"messages": USER, "tools": tools}).encode())
    with pytest.raises(ApiError) as info:
        openai_prompts.chat_tools(request, None)
    assert info.value.status == 400 and info.value.body()["error"]["param"] == "tools"
    assert openai_prompts.chat_tools(request, tool_call_tags(tok)) == tools
    prompt = openai_prompts.chat_prompt_ids(
        request, tok, None, openai_prompts.chat_tools(request, tool_call_tags(tok))
    )[0]
    assert tok.decode(prompt).count("<tool_call>") == 1  # the template asks for calls
