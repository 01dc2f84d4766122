"""OpenAI's Responses API (`POST /v1/responses`) as a chat: its request checked and turned into the chat
completion request that means the same, so that one path (template, tools, structured output, reasoning,
sampling) serves both.

What maps is `as_chat`'s.

Nothing is stored: `store` is answered false, and what needs a stored response or conversation
(`previous_response_id`, `conversation`, `item_reference` items, `background`) is a 400, as are the
built-in tools (web search, files, ...) and `truncation` "auto" (an input that does not fit is a 400, not
cut). `reasoning` and `metadata` are echoed.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, JsonValue, ValidationError

from common.openai.api import (
    INT64_MAX,
    INT64_MIN,
    ApiError,
    ChatCompletionRequest,
    Schema,
    bad_request,
    parse_body,
    validation_error,
)
from common.protocol import MAX_TOP_LOGPROBS

LOGPROBS_INCLUDE = "message.output_text.logprobs"
"""The `include` entry that asks for the output text's log-probabilities."""
IGNORED_INCLUDES = frozenset({"reasoning.encrypted_content"})
"""`include` entries accepted with nothing to add: the reasoning is never encrypted (its text is in the
reasoning item)."""
MAX_METADATA = 16


class TextConfig(Schema):
    format: dict[str, JsonValue] | None = None
    """{"type": "text" | "json_object"} or {"type": "json_schema", "name", "schema", "strict", ...}."""
    verbosity: str | None = None


class ResponsesRequest(Schema):
    """A `/v1/responses` body (OpenAI's fields, plus the chat's sampling extensions)."""

    model: str | None = None
    input: str | list[JsonValue]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    include: list[str] | None = None
    tools: list[JsonValue] | None = None
    tool_choice: JsonValue = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: dict[str, JsonValue] | None = None
    metadata: dict[str, str] | None = None
    stream: bool | None = False
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: JsonValue = None
    background: bool | None = None
    truncation: str | None = None
    # The chat's extensions.
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100.0)
    chat_template_kwargs: dict[str, JsonValue] | None = None


def parse_responses_request(body: bytes) -> ResponsesRequest:
    """Validate a `/v1/responses` body; raises ApiError (400)."""
    request = parse_body(ResponsesRequest, body)
    _refuse_unsupported(request)
    return request


def _refuse_unsupported(request: ResponsesRequest) -> None:
    stored = {"previous_response_id": request.previous_response_id, "conversation": request.conversation}
    for name, value in stored.items():
        if value is not None:
            raise bad_request(
                f"{name} is not supported: this server stores no responses.", name, "unsupported"
            )
    if request.background:
        raise bad_request("background is not supported.", "background", "unsupported")
    if request.truncation not in (None, "disabled"):
        raise bad_request(
            'truncation "auto" is not supported: an input that does not fit is refused, not cut.',
            "truncation",
            "unsupported",
        )
    for entry in request.include or ():
        if entry != LOGPROBS_INCLUDE and entry not in IGNORED_INCLUDES:
            raise bad_request(f"include '{entry}' is not supported.", "include", "unsupported")
    if request.metadata is not None and len(request.metadata) > MAX_METADATA:
        raise bad_request(f"metadata holds at most {MAX_METADATA} pairs.", "metadata")


SAME_FIELDS = (
    "model", "temperature", "top_p", "seed", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "chat_template_kwargs",
)  # fmt: skip
"""The fields a Responses request shares with the chat, under the same names."""


def wants_logprobs(request: ResponsesRequest) -> bool:
    """The output text's log-probabilities are asked for (`top_logprobs`, or the `include` entry)."""
    return request.top_logprobs is not None or LOGPROBS_INCLUDE in (request.include or ())


def as_chat(request: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that asks what `request` asks (checked by the chat's own validation).

    What maps: `instructions` (a system message first), `input` (a string, or items: messages with
    `input_text`, `output_text` and `input_image` parts; `function_call` and `function_call_output` items as
    the assistant's calls and the tool's results; a `reasoning` item as the next assistant message's
    `reasoning_content`), `max_output_tokens`, `temperature`, `top_p`, `top_logprobs` (or `include` of
    `message.output_text.logprobs`), function `tools` (their flat form), `tool_choice`,
    `parallel_tool_calls`, `text.format` (as `response_format`), and the chat's sampling extensions (`seed`,
    `top_k`, `min_p`, the penalties, `chat_template_kwargs`)."""
    fields: dict[str, Any] = {
        "messages": chat_messages(request),
        "max_completion_tokens": request.max_output_tokens,
        "logprobs": wants_logprobs(request) or None,
        "top_logprobs": request.top_logprobs,
        "tools": _chat_tools(request.tools),
        "tool_choice": _chat_tool_choice(request.tool_choice),
        "parallel_tool_calls": request.parallel_tool_calls,
        "response_format": _response_format(request.text),
        "stream": request.stream,
    }
    fields |= {name: getattr(request, name) for name in SAME_FIELDS}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:  # what the items' own checks let through
        raise validation_error(exc) from None


def chat_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """`instructions` and `input` as chat messages."""
    messages = _Conversation()
    if request.instructions is not None:
        messages.add({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        messages.add({"role": "user", "content": request.input})
        return messages.list
    for i, item in enumerate(request.input):
        if not isinstance(item, dict):
            raise bad_request("An input item is an object.", f"input[{i}]")
        messages.item(item, f"input[{i}]")
    if not messages.list:
        raise bad_request("The input is empty.", "input")
    return messages.list


class _Conversation:
    """Chat messages built from input items in order: an assistant's function calls join the assistant
    message before them (or one of their own), a reasoning item waits for the assistant message after it."""

    def __init__(self) -> None:
        self.list: list[dict[str, Any]] = []
        self._reasoning: str | None = None

    def add(self, message: dict[str, Any]) -> None:
        if message["role"] == "assistant" and self._reasoning is not None:
            message["reasoning_content"], self._reasoning = self._reasoning, None
        self.list.append(message)

    def item(self, item: dict[str, Any], param: str) -> None:
        kind = item.get("type", "message")
        if kind == "message":
            self._message(item, param)
        elif kind == "function_call":
            self._call(item, param)
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _parts_text(output, f"{param}.output")
            self.add({"role": "tool", "tool_call_id": _string(item, "call_id", param), "content": text})
        elif kind == "reasoning":
            self._reasoning = (self._reasoning or "") + _reasoning_text(item, param)
        else:
            raise bad_request(
                f"Input items of type '{kind}' are not supported.", f"{param}.type", "unsupported"
            )

    def _message(self, item: dict[str, Any], param: str) -> None:
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise bad_request("A message's role is user, system, developer or assistant.", f"{param}.role")
        content = item.get("content")
        if isinstance(content, str):
            self.add({"role": role, "content": content})
        elif isinstance(content, list):
            self.add(
                {"role": role, "content": [_part(p, f"{param}.content[{j}]") for j, p in enumerate(content)]}
            )
        else:
            raise bad_request("A message's content is a string or a list of parts.", f"{param}.content")

    def _call(self, item: dict[str, Any], param: str) -> None:
        call = {
            "id": _string(item, "call_id", param),
            "type": "function",
            "function": {
                "name": _string(item, "name", param),
                "arguments": _string(item, "arguments", param),
            },
        }
        last = self.list[-1] if self.list else None
        if last is not None and last["role"] == "assistant" and self._reasoning is None:
            last.setdefault("tool_calls", []).append(call)
        else:
            self.add({"role": "assistant", "content": None, "tool_calls": [call]})


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"'{key}' is a string.", f"{param}.{key}")
    return value


def _part(part: JsonValue, param: str) -> dict[str, Any]:
    """An input message's content part as the chat's (`text`, `image_url`)."""
    fields: dict[str, JsonValue] = part if isinstance(part, dict) else {}
    kind = fields.get("type")
    if kind in ("input_text", "output_text", "text") and isinstance(fields.get("text"), str):
        return {"type": "text", "text": fields["text"]}
    if kind == "refusal" and isinstance(fields.get("refusal"), str):
        return {"type": "text", "text": fields["refusal"]}
    if kind == "input_image":
        url = fields.get("image_url")
        if not isinstance(url, str):
            raise bad_request("An input_image part gives its image as a data: URL in image_url.", param)
        return {"type": "image_url", "image_url": {"url": url}}
    raise bad_request(f"Unsupported content part of type '{kind}'.", param, "unsupported")


def _parts_text(parts: JsonValue, param: str) -> str:
    """A function call's output given as text parts, joined."""
    if not isinstance(parts, list):
        raise bad_request("A function call's output is a string or a list of text parts.", param)
    texts = [_part(p, f"{param}[{j}]") for j, p in enumerate(parts)]
    if any(t["type"] != "text" for t in texts):
        raise bad_request("A function call's output holds text parts only.", param, "unsupported")
    return "".join(t["text"] for t in texts)


def _reasoning_text(item: dict[str, Any], param: str) -> str:
    """A reasoning item's text: its reasoning_text parts, else its summary's."""
    for key in ("content", "summary"):
        parts = item.get(key) or []
        if not isinstance(parts, list):
            raise bad_request(f"A reasoning item's {key} is a list of parts.", f"{param}.{key}")
        texts = [p.get("text") for p in parts if isinstance(p, dict)]
        strings = [t for t in texts if isinstance(t, str)]
        if texts and len(strings) == len(texts):
            return "".join(strings)
    return ""


def _chat_tools(tools: list[JsonValue] | None) -> list[dict[str, Any]] | None:
    """Function tools in the chat's nested form; any other kind is a 400."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function" or not isinstance(tool, dict):
            raise bad_request(
                f"Only function tools are supported, not '{kind}'.", f"tools[{i}].type", "unsupported"
            )
        function = {k: v for k, v in tool.items() if k in ("name", "description", "parameters", "strict")}
        if not isinstance(function.get("name"), str):
            raise bad_request("A function tool has a name.", f"tools[{i}].name")
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: JsonValue) -> JsonValue:
    """`tool_choice` in the chat's form: a named function nests its name."""
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request(
                'tool_choice is "auto", "none", "required" or {"type": "function", "name": ...}.',
                "tool_choice",
                "unsupported",
            )
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: TextConfig | None) -> dict[str, JsonValue] | None:
    """`text.format` as the chat's `response_format` (a json_schema's fields nest under `json_schema`)."""
    given = text.format if text is not None else None
    if given is None or given.get("type") != "json_schema":
        return given
    schema = {k: v for k, v in given.items() if k != "type"}
    return {"type": "json_schema", "json_schema": schema}


CHAT_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "logprobs": "top_logprobs",
}
"""The chat request's parameters that a Responses request names otherwise."""


def chat_param_error(error: ApiError) -> ApiError:
    """`error`, raised checking the chat that `as_chat` made, naming the Responses request's parameter."""
    param = error.param or ""
    head = re.split(r"[.\[]", param, maxsplit=1)[0]
    if head not in CHAT_PARAMS:
        return error
    rest = "" if head == "messages" else param[len(head) :]  # a message is not an input item one for one
    return ApiError(
        error.status, error.message, type=error.type, param=CHAT_PARAMS[head] + rest, code=error.code
    )
