"""A Responses API request as the chat it maps to (common/openai/responses.py): items to messages (calls
join the assistant message before them, a reasoning item waits for the next assistant message), tools and
tool_choice to the chat's nested forms, text.format to response_format, and the chat's errors renamed to the
Responses request's parameters."""

from __future__ import annotations

import json

import pytest

from common.openai.api import ApiError
from common.openai.responses import as_chat, chat_param_error, parse_responses_request


def chat_of(body: dict) -> dict:
    return as_chat(parse_responses_request(json.dumps(body).encode())).model_dump(exclude_none=True)


def call(cid: str) -> dict:
    return {"type": "function_call", "call_id": cid, "name": "f", "arguments": "{}"}


def test_items_become_messages() -> None:
    items = [
        {"role": "user", "content": "Go."},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Think."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "On it."}]},
        call("c1"),
        call("c2"),
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "1"}]},
        {"type": "function_call_output", "call_id": "c2", "output": "2"},
    ]
    messages = chat_of({"input": items, "instructions": "Rules."})["messages"]
    fn = {"name": "f", "arguments": "{}"}
    assert messages == [
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": "Go."},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "On it."}],
            "reasoning_content": "Think.",
            "tool_calls": [{"id": c, "type": "function", "function": fn} for c in ("c1", "c2")],
        },
        {"role": "tool", "content": "1", "tool_call_id": "c1"},
        {"role": "tool", "content": "2", "tool_call_id": "c2"},
    ]


def test_tools_choice_and_format_take_the_chats_forms() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = chat_of(
        {
            "input": "Hi",
            "tools": [{"type": "function", "name": "f", "parameters": schema, "strict": True}],
            "tool_choice": {"type": "function", "name": "f"},
            "text": {"format": {"type": "json_schema", "name": "answer", "schema": schema}},
            "max_output_tokens": 7,
            "top_logprobs": 3,
        }
    )
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}}
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": schema},
    }
    assert chat["max_completion_tokens"] == 7 and chat["logprobs"] is True and chat["top_logprobs"] == 3
    assert chat_of({"input": "Hi", "include": ["message.output_text.logprobs"]})["logprobs"] is True
    assert "logprobs" not in chat_of({"input": "Hi"})


@pytest.mark.parametrize(
    ("chat_param", "param"),
    [
        ("messages[3].content", "input"),
        ("max_completion_tokens", "max_output_tokens"),
        ("response_format.json_schema", "text.format.json_schema"),
        ("tools[0]", "tools[0]"),
        (None, None),
    ],
)
def test_chat_errors_name_the_responses_parameters(chat_param: str | None, param: str | None) -> None:
    error = chat_param_error(ApiError(400, "bad", param=chat_param, code="x"))
    assert (error.status, error.message, error.code, error.param) == (400, "bad", "x", param)
