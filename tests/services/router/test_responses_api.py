"""OpenAI's Responses API (`POST /v1/responses`) through the router, driven by the official client: a
plain answer, streamed and not, as a message item; function calls as function_call items; a conversation of
input items (instructions, calls and their outputs) rendered as the chat it maps to; reasoning as a
reasoning item; a cut answer `incomplete`; a failure mid-stream `response.failed`; and the request's
problems as 400s naming its own parameters."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from common.text.tokenizer import Tokenizer
from tests.services.router.conftest import REPLY, THINK_REPLY, TOOL_REPLY, serve_router
from tests.services.router.test_reasoning import _thinking_model
from tests.services.router.test_tools import cut_after_the_name

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]


def client(served: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=10)


def generate_of(served: Any, response_id: str) -> Any:
    return next(g for g in served.peer.generates() if f"resp_{g.rid}" == response_id)


def test_an_answer_is_a_message_item(served: Any, tok: Tokenizer) -> None:
    out = client(served).responses.create(model="tiny", input="Say hello.", instructions="Be brief.")
    assert out.id.startswith("resp_") and out.object == "response" and out.status == "completed"
    (message,) = out.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert out.output_text == REPLY and message.content[0].annotations == []
    assert out.instructions == "Be brief." and out.store is False and out.model == "tiny"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    prompt = tok.apply_chat_template(chat, tokenize=True)
    assert generate_of(served, out.id).prompt_ids == prompt
    usage = out.usage
    assert usage.input_tokens == len(prompt) and usage.output_tokens == len(tok.encode(REPLY)) + 1  # EOS
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0


def test_a_streamed_answer_comes_as_numbered_events(served: Any) -> None:
    events = list(client(served).responses.create(model="tiny", input="Say hello.", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == REPLY == events[-4].text
    done = events[-1].response
    assert done.status == "completed" and done.output_text == REPLY and done.usage.output_tokens > 0
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert done.output[0].id == events[2].item.id


@pytest.mark.parametrize("stream", [False, True])
def test_calls_are_function_call_items(served: Any, stream: bool) -> None:
    ask = "[tool] Weather in Paris?"
    if stream:
        events = list(client(served).responses.create(model="tiny", input=ask, tools=TOOLS, stream=True))
        out = events[-1].response
        arguments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        assert len(arguments) > 2  # written as they come
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert [json.loads(e.arguments) for e in done] == [{"city": "Paris"}, {"city": "Lyon"}]
    else:
        out = client(served).responses.create(model="tiny", input=ask, tools=TOOLS)
    assert out.status == "completed" and out.tools[0].name == "get_weather"
    message, paris, lyon = out.output
    assert message.type == "message" and out.output_text == TOOL_REPLY[: TOOL_REPLY.index("<tool_call>")]
    for call, city in ((paris, "Paris"), (lyon, "Lyon")):
        assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
        assert call.call_id.startswith("call_") and json.loads(call.arguments) == {"city": city}
    assert paris.call_id != lyon.call_id and paris.id.startswith("fc_")


def test_input_items_render_as_the_chat_they_map_to(served: Any, tok: Tokenizer) -> None:
    items = [
        {"role": "developer", "content": "Use the tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "[tool] Weather in Paris?"}]},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C and clear"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "18 C."}]},
        {"role": "user", "content": "Thanks."},
    ]
    out = client(served).responses.create(model="tiny", input=items, tools=TOOLS, tool_choice="auto")
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    chat = [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "[tool] Weather in Paris?"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and clear"},
        {"role": "assistant", "content": "18 C."},
        {"role": "user", "content": "Thanks."},
    ]
    assert generate_of(served, out.id).prompt_ids == tok.apply_chat_template(
        chat, tools=CHAT_TOOLS, tokenize=True
    )


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_max_output_tokens_is_an_incomplete_call(
    served: Any, tok: Tokenizer, stream: bool
) -> None:
    ask = {"model": "tiny", "input": "[tool] Weather in Paris?", "tools": TOOLS}
    ask["max_output_tokens"] = cut_after_the_name(tok)
    if stream:
        out = list(client(served).responses.create(**ask, stream=True))[-1].response
    else:
        out = client(served).responses.create(**ask)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    message, call = out.output
    assert message.type == "message" and out.output_text == "Let me look.\n"
    assert call.type == "function_call" and call.name == "get_weather" and call.arguments == ""
    assert call.status == "incomplete"


def test_a_cut_answer_is_incomplete(served: Any) -> None:
    out = client(served).responses.create(model="tiny", input="Say hello.", max_output_tokens=3)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.output[0].status == "incomplete" and out.usage.output_tokens == 3
    events = list(
        client(served).responses.create(model="tiny", input="Hi.", max_output_tokens=3, stream=True)
    )
    assert events[-1].type == "response.incomplete" and events[-1].response.output[0].status == "incomplete"


def test_logprobs_come_with_the_output_text(served: Any) -> None:
    out = client(served).responses.create(
        model="tiny", input="Say hello.", top_logprobs=2, include=["message.output_text.logprobs"]
    )
    logprobs = out.output[0].content[0].logprobs
    assert len(logprobs) == out.usage.output_tokens and all(len(e.top_logprobs) == 2 for e in logprobs)
    events = list(
        client(served).responses.create(model="tiny", input="Say hello.", top_logprobs=1, stream=True)
    )
    streamed = [entry for e in events if e.type == "response.output_text.delta" for entry in e.logprobs]
    assert len(streamed) == len(events[-1].response.output[0].content[0].logprobs) > 0


def test_a_failure_mid_stream_is_response_failed(served: Any) -> None:
    events = list(client(served).responses.create(model="tiny", input="[error-mid] Hi.", stream=True))
    assert events[-1].type == "response.failed"
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "worker_error"
    assert failed.output[0].status == "incomplete"


@pytest.fixture(scope="module")
def thinking(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with serve_router(
        model_dir=_thinking_model(tmp_path_factory.mktemp("models"), tags_as_tokens=False)
    ) as s:
        yield s


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_is_a_reasoning_item(thinking: Any, stream: bool) -> None:
    ask = "[think] What is 2 + 2?"
    if stream:
        events = list(client(thinking).responses.create(model="tiny", input=ask, stream=True))
        out = events[-1].response
        deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert deltas == "Two and two make four.\n"
    else:
        out = client(thinking).responses.create(model="tiny", input=ask)
    reasoning, message = out.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Two and two make four.\n"
    assert message.type == "message" and out.output_text == "It is 4."
    assert 0 < out.usage.output_tokens_details.reasoning_tokens < out.usage.output_tokens
    assert THINK_REPLY.startswith(reasoning.content[0].text)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": []}, "input"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0]",
        ),
        ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "Hi", "truncation": "auto"}, "truncation"),
        ({"input": "Hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": "Hi", "include": ["file_search_call.results"]}, "include"),
        ({"input": "x " * 600}, "input"),
        ({"input": "Hi", "text": {"format": {"type": "xml"}}}, "text.format"),
    ],
)
def test_problems_are_400s_naming_the_parameter(served: Any, body: dict, param: str) -> None:
    reply = httpx.post(f"{served.url}/v1/responses", json={"model": "tiny", **body}, timeout=10)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_an_unknown_model_is_a_404(served: Any) -> None:
    with pytest.raises(openai.NotFoundError):
        client(served).responses.create(model="gpt-5", input="Hi")
