"""Function calls through the router: the tools reach the chat template, the model's <tool_call> blocks
come back as OpenAI `tool_calls` (streamed and not) with finish reason "tool_calls", a conversation that
carries calls and their results is rendered as the template renders it, and what cannot be honoured is a
400."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest

from common.model.defaults import default_model_dir
from common.model.synthetic.tokenizer import CHAT_TEMPLATE
from common.text.tokenizer import Tokenizer
from tests.services.router.conftest import TOOL_REPLY, TOOL_REPLY_XML, serve_router, streamed_calls

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
ASK = [{"role": "user", "content": "[tool] Weather in Paris?"}]


def client(served: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=10)


def test_a_call_comes_back_as_tool_calls(served: Any, tok: Tokenizer) -> None:
    out = client(served).chat.completions.create(model="tiny", messages=ASK, tools=TOOLS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == TOOL_REPLY[: TOOL_REPLY.index("<tool_call>")]
    paris, lyon = choice.message.tool_calls
    assert paris.type == "function" and paris.id.startswith("call_") and paris.id != lyon.id
    assert paris.function.name == "get_weather" and json.loads(paris.function.arguments) == {"city": "Paris"}
    assert json.loads(lyon.function.arguments) == {"city": "Lyon"}
    gen = next(g for g in served.peer.generates() if f"chatcmpl-{g.rid}" == out.id)
    assert gen.prompt_ids == tok.apply_chat_template(ASK, tools=TOOLS, tokenize=True)


def test_streamed_calls_arrive_in_pieces_and_numbered(served: Any) -> None:
    chunks = list(
        client(served).chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, stream=True)
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == TOOL_REPLY[: TOOL_REPLY.index("<tool_call>")]
    pieces = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert len(pieces) > 4  # each call's name first, then its arguments as they are written
    calls = streamed_calls(chunks)
    assert [(d.index, d.name, json.loads(d.arguments)) for d in calls] == [
        (0, "get_weather", {"city": "Paris"}),
        (1, "get_weather", {"city": "Lyon"}),
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_in_xml_comes_back_with_its_arguments_typed(served: Any, stream: bool) -> None:
    """Qwen3-Coder's form (Qwen3.5's templates): the values are bare text, typed by the tool's schema."""
    properties = {"city": {"type": "string"}, "days": {"type": "integer"}}
    function = {**TOOLS[0]["function"], "parameters": {"type": "object", "properties": properties}}
    tools = [{"type": "function", "function": function}]
    ask = [{"role": "user", "content": "[tool-xml] Weather in Paris?"}]
    made = client(served).chat.completions.create(model="tiny", messages=ask, tools=tools, stream=stream)
    if stream:
        chunks = list(made)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
        calls = streamed_calls(chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        assert made.choices[0].message.content is None
        calls, finish = (
            [c.function for c in made.choices[0].message.tool_calls],
            made.choices[0].finish_reason,
        )
    assert [(f.name, json.loads(f.arguments)) for f in calls] == [
        ("get_weather", {"city": "Paris", "days": 3})
    ]
    assert finish == "tool_calls"
    untyped = client(served).chat.completions.create(model="tiny", messages=ask, tools=TOOLS)
    assert json.loads(untyped.choices[0].message.tool_calls[0].function.arguments) == {
        "city": "Paris",
        "days": "3",
    }
    plain = client(served).chat.completions.create(model="tiny", messages=ask)
    assert plain.choices[0].message.content == TOOL_REPLY_XML


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_ends_the_answer_with_its_first_call(served: Any, stream: bool) -> None:
    ask = {"model": "tiny", "messages": ASK, "tools": TOOLS, "parallel_tool_calls": False}
    if stream:
        chunks = list(client(served).chat.completions.create(**ask, stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        calls = [(d.name, json.loads(d.arguments)) for d in streamed_calls(chunks)]
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = client(served).chat.completions.create(**ask).choices[0]
        content, finish = choice.message.content, choice.finish_reason
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris"})] and finish == "tool_calls"  # the reply has two
    assert content == TOOL_REPLY[: TOOL_REPLY.index("<tool_call>")]


def test_without_tools_the_text_is_the_text(served: Any) -> None:
    out = client(served).chat.completions.create(model="tiny", messages=ASK)
    assert out.choices[0].message.content == TOOL_REPLY and out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.tool_calls is None
    none = client(served).chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="none")
    assert none.choices[0].message.content == TOOL_REPLY


def test_a_conversation_with_calls_and_results_renders_as_the_template(served: Any, tok: Tokenizer) -> None:
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and clear"},
    ]
    out = client(served).chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
    gen = next(g for g in served.peer.generates() if f"chatcmpl-{g.rid}" == out.id)
    want = [{k: v for k, v in m.items() if v is not None} for m in messages]
    assert gen.prompt_ids == tok.apply_chat_template(want, tools=TOOLS, tokenize=True)


def cut_after_the_name(tok: Tokenizer) -> int:
    """The max_tokens that cuts TOOL_REPLY's first call right after its name, before its arguments."""
    ids = tok.encode(TOOL_REPLY)
    return next(n for n in range(1, len(ids)) if '"get_weather",' in tok.decode(ids[:n]))


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_max_tokens_is_a_call(served: Any, tok: Tokenizer, stream: bool) -> None:
    """A call cut before its arguments comes back as a call (the arguments written: none), finish reason
    "length", and nothing of its block in the content (OpenAI's and vLLM's answer)."""
    ask = {"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": cut_after_the_name(tok)}
    if stream:
        chunks = list(client(served).chat.completions.create(**ask, stream=True))
        calls = streamed_calls(chunks)
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        (finish,) = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        out = client(served).chat.completions.create(**ask)
        calls = [
            SimpleNamespace(name=c.function.name, arguments=c.function.arguments)
            for c in out.choices[0].message.tool_calls
        ]
        content, finish = out.choices[0].message.content or "", out.choices[0].finish_reason
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", "")]
    assert content == "Let me look.\n" and finish == "length"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_holds_the_answer_to_a_call_block(served: Any, choice: Any) -> None:
    """tool_choice "required" or named: the workers get the form of one <tool_call> block of the function's
    arguments (common/sampling/structured.py); "auto" leaves the answer free."""
    out = client(served).chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice)
    gen = next(g for g in served.peer.generates() if f"chatcmpl-{g.rid}" == out.id)
    form = json.loads(gen.sampling.structure)
    assert form["before"] == "<tool_call>\n" and form["after"] == "\n</tool_call>"
    assert form["schema"]["properties"]["name"] == {"const": "get_weather"}
    assert form["schema"]["properties"]["arguments"] == TOOLS[0]["function"]["parameters"]
    auto = client(served).chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="auto")
    assert next(g for g in served.peer.generates() if f"chatcmpl-{g.rid}" == auto.id).sampling.structure == ""


JSON_CALL = '{{- \'{\\"name\\": ..., \\"arguments\\": {...}}\\n\' }}'
XML_CALL = "{{- '<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n' }}"


def _xml_call_model(root: Path) -> Path:
    """The tiny model with a template that asks for calls in the XML form, as Qwen3-Coder's does."""
    assert JSON_CALL in CHAT_TEMPLATE
    model = root / "xml-calls"
    model.mkdir()
    for file in default_model_dir().iterdir():
        if file.name != "tokenizer_config.json":
            (model / file.name).symlink_to(file)
    config = json.loads((default_model_dir() / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE.replace(JSON_CALL, XML_CALL)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model


def test_a_forced_call_takes_the_form_the_template_asks_for(tmp_path: Path) -> None:
    """Where the template writes calls in the XML form, a forced call is held to one block in that form
    (common/sampling/structured.py's xml_calls), whose arguments come back as JSON."""
    with serve_router(model_dir=_xml_call_model(tmp_path)) as served:
        client(served).chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice="required"
        )
        (gen,) = served.peer.generates()
    form = json.loads(gen.sampling.structure)
    assert form["tags"] == ["<tool_call>", "</tool_call>"]
    assert form["xml_calls"] == [{"name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        ({"tools": TOOLS, "tool_choice": "required", "ignore_eos": True}, "ignore_eos"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0]"),
        ({"tools": ["get_weather"]}, "tools[0]"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_what_cannot_be_honoured_is_a_400(served: Any, extra: dict, param: str) -> None:
    response = httpx.post(
        f"{served.url}/v1/chat/completions", json={"model": "tiny", "messages": ASK, **extra}, timeout=10
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == param
