"""The Responses API's bodies and stream events (`POST /v1/responses`; the request side is
common/openai/responses.py).

A response's `output` holds, in the order the model wrote them, a `reasoning` item (the reasoning block's
text, where the model's template has one), a `message` item with one `output_text` part, and a
`function_call` item a call. A stream opens with `response.created` and `response.in_progress`, gives each
item as `response.output_item.added`, its deltas and its `.done` events, and ends with `response.completed`
(`response.incomplete` when `max_output_tokens` cut it, `response.failed` when the workers failed it),
which carries the whole response; every event is an SSE `event:` line and a `data:` line, numbered by
`sequence_number`. There is no `[DONE]`.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from common.openai.api import ApiError
from common.openai.responses import ResponsesRequest
from common.openai.tool_calls import CallDelta
from services.router.responses import ChoiceResult


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(
    text: str, logprobs: list[Any] | None, status: str, iid: str | None = None
) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {
        "type": "message",
        "id": iid or item_id("msg"),
        "status": status,
        "role": "assistant",
        "content": [part],
    }


def reasoning_item(text: str, iid: str | None = None) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": iid or item_id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def call_item(call_id: str, name: str, arguments: str, status: str, iid: str | None = None) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": iid or item_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def usage(input_tokens: int, output_tokens: int, reasoning_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


def status_of(finish_reason: str | None) -> str:
    """A response's (and its last item's) status: cut by max_output_tokens, or complete."""
    return "incomplete" if finish_reason == "length" else "completed"


@dataclass(frozen=True)
class ResponseBody:
    """The response object of one request: what it echoes of the request, and its output as it stands."""

    request: ResponsesRequest
    rid: str
    model: str
    created_at: int

    @property
    def id(self) -> str:
        return f"resp_{self.rid}"

    def object(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        error: ApiError | None = None,
    ) -> dict[str, Any]:
        req = self.request
        text = req.text.format if req.text is not None and req.text.format is not None else {"type": "text"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None
            if error is None
            else {"code": error.code or "server_error", "message": error.message},
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": req.reasoning or {"effort": None, "summary": None},
            "store": False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": text},
            "tool_choice": "auto" if req.tool_choice is None else req.tool_choice,
            "tools": req.tools or [],
            "top_logprobs": req.top_logprobs or 0,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled",
            "usage": usage,
            "metadata": req.metadata or {},
        }

    def full(
        self, result: ChoiceResult, input_tokens: int, output_tokens: int, reasoning_tokens: int
    ) -> dict:
        """The finished response (not streamed)."""
        status = status_of(result.finish_reason)
        output = []
        if result.reasoning:
            output.append(reasoning_item(result.reasoning))
        logprobs = None if result.logprobs is None else result.logprobs["content"]
        if result.text is not None and (result.text or not result.tool_calls):
            output.append(message_item(result.text, logprobs, "completed"))
        for call in result.tool_calls or ():
            function = call["function"]
            output.append(call_item(call["id"], function["name"], function["arguments"], "completed"))
        if output:
            output[-1]["status"] = status  # the item a cut ends in, as the stream closes it
        return self.object(status, output, usage(input_tokens, output_tokens, reasoning_tokens))


def event(kind: str, sequence: int, **fields: Any) -> bytes:
    """One stream event: `event: kind` and its data, numbered `sequence`."""
    data = json.dumps({"type": kind, "sequence_number": sequence, **fields}, ensure_ascii=False)
    return f"event: {kind}\ndata: {data}\n\n".encode()


@dataclass
class _Open:
    """The item being streamed: its place in the output, its item as it stands, and its text so far."""

    index: int
    item: dict[str, Any]
    text: str = ""
    logprobs: list[Any] | None = None


@dataclass
class ResponseStream:
    """Turns a streamed choice's pieces (Choice.streamed) into Responses events, and keeps the output."""

    body: ResponseBody
    logprobs: bool = False
    """The request asked for the output text's log-probabilities."""
    output: list[dict[str, Any]] = field(default_factory=list)
    reasoning: str = ""
    """Every piece of reasoning streamed (its tokens count in the usage)."""
    _sequence: int = 0
    _open: _Open | None = None

    def _event(self, kind: str, **fields: Any) -> bytes:
        self._sequence += 1
        return event(kind, self._sequence - 1, **fields)

    def start(self) -> list[bytes]:
        response = self.body.object("in_progress", [])
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def push(
        self, reasoning: str, content: str, logprobs: list[Any] | None, calls: list[CallDelta]
    ) -> list[bytes]:
        """The events of one delta: its reasoning, its content (with its tokens' log-probabilities), then
        the pieces of calls it writes; each kind of text in an item of its own."""
        out: list[bytes] = []
        if reasoning:
            out += self._text("reasoning", reasoning, None)
        if content:
            out += self._text("message", content, logprobs)
        for piece in calls:
            if piece.id is not None:
                out += self._close("completed")
                out += self._add(call_item(piece.id, piece.name or "", "", "in_progress"))
            assert self._open is not None and self._open.item["type"] == "function_call", (
                "a call's piece first"
            )
            self._open.text += piece.arguments
            if piece.arguments:
                out.append(self._delta("response.function_call_arguments.delta", piece.arguments))
        return out

    def finish(
        self, finish_reason: str, input_tokens: int, output_tokens: int, reasoning_tokens: int
    ) -> list[bytes]:
        """The open item's end, then the whole response (`response.completed`, or `.incomplete`)."""
        status = status_of(finish_reason)
        out = self._close(status)
        response = self.body.object(status, self.output, usage(input_tokens, output_tokens, reasoning_tokens))
        return [*out, self._event(f"response.{status}", response=response)]

    def fail(self, error: ApiError) -> list[bytes]:
        """The open item's end, then `response.failed` with the error."""
        out = self._close("incomplete")
        return [
            *out,
            self._event("response.failed", response=self.body.object("failed", self.output, error=error)),
        ]

    def _text(self, kind: str, text: str, logprobs: list[Any] | None) -> list[bytes]:
        out: list[bytes] = []
        if self._open is None or self._open.item["type"] != kind:
            out += self._close("completed")
            item = (
                reasoning_item("")
                if kind == "reasoning"
                else message_item("", [] if self.logprobs else None, "in_progress")
            )
            out += self._add(item)
            part = item["content"][0]
            out.append(self._part("response.content_part.added", part))
        opened = self._open
        assert opened is not None
        opened.text += text
        if kind == "reasoning":
            self.reasoning += text
            out.append(self._delta("response.reasoning_text.delta", text, content_index=0))
        else:
            entries = logprobs or []
            if opened.logprobs is not None:
                opened.logprobs += entries
            out.append(self._delta("response.output_text.delta", text, content_index=0, logprobs=entries))
        return out

    def _add(self, item: dict[str, Any]) -> list[bytes]:
        self._open = _Open(
            len(self.output), item, logprobs=[] if item["type"] == "message" and self.logprobs else None
        )
        self.output.append(item)
        shown = {**item, "content": []} if "content" in item else item  # its part comes as content_part.added
        return [self._event("response.output_item.added", output_index=self._open.index, item=shown)]

    def _delta(self, kind: str, delta: str, **fields: Any) -> bytes:
        opened = self._open
        assert opened is not None
        return self._event(kind, item_id=opened.item["id"], output_index=opened.index, delta=delta, **fields)

    def _part(self, kind: str, part: dict[str, Any]) -> bytes:
        opened = self._open
        assert opened is not None
        fields = {"item_id": opened.item["id"], "output_index": opened.index, "content_index": 0}
        return self._event(kind, **fields, part=part)

    def _close(self, status: str) -> list[bytes]:
        """The open item's `.done` events, its final form in the output (none open: nothing)."""
        opened = self._open
        if opened is None:
            return []
        item, fields = opened.item, {"item_id": opened.item["id"], "output_index": opened.index}
        out = []
        if item["type"] == "function_call":
            item.update(arguments=opened.text, status=status)
            done = {"name": item["name"], "arguments": opened.text}
            out.append(self._event("response.function_call_arguments.done", **fields, **done))
        elif item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": opened.text}]
            out.append(
                self._event("response.reasoning_text.done", **fields, content_index=0, text=opened.text)
            )
            out.append(self._part("response.content_part.done", item["content"][0]))
        else:
            final = message_item(opened.text, opened.logprobs, status, item["id"])
            item.update(final)
            done = {"content_index": 0, "text": opened.text, "logprobs": opened.logprobs or []}
            out.append(self._event("response.output_text.done", **fields, **done))
            out.append(self._part("response.content_part.done", item["content"][0]))
        self._open = None
        out.append(self._event("response.output_item.done", output_index=opened.index, item=item))
        return out
