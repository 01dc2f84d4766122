"""OpenAI response bodies and server-sent-event chunks, for chat and text completions.

The shapes are OpenAI's: `chat.completion` / `chat.completion.chunk` (the first chunk carries the role,
the last the finish reason) and `text_completion` for both forms of the legacy endpoint. With
`stream_options.include_usage`, every chunk has `"usage": null` and a last chunk with no choices carries it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying `payload` as JSON."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass(frozen=True)
class ChoiceResult:
    """What a finished choice says: its text (None: a chat message of calls alone), finish reason,
    log-probabilities (services/router/logprobs.py), function calls (OpenAI's `tool_calls` entries) and
    reasoning (a chat message's `reasoning_content`; None: it has none)."""

    text: str | None
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning: str | None = None


@dataclass(frozen=True)
class ResponseBuilder:
    """Builds the bodies of one request's response (chat or text completion)."""

    chat: bool
    rid: str
    model: str
    created: int
    """Unix seconds when the request arrived (OpenAI's `created`)."""
    include_usage: bool = False

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{self.rid}"

    def full(
        self, choices: Sequence[ChoiceResult], prompt_tokens: int, completion_tokens: int
    ) -> dict[str, Any]:
        """The non-streaming response, its choices in index order."""
        body = []
        for index, result in enumerate(choices):
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": result.text}
                if result.reasoning is not None:
                    message["reasoning_content"] = result.reasoning
                if result.tool_calls:
                    message["tool_calls"] = result.tool_calls
                choice: dict[str, Any] = {"index": index, "message": message}
            else:
                choice = {"index": index, "text": result.text}
            choice.update(finish_reason=result.finish_reason, logprobs=result.logprobs)
            body.append(choice)
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": body,
            "usage": usage(prompt_tokens, completion_tokens),
        }

    def role_chunk(self, index: int = 0) -> bytes:
        """A chat choice's first chunk: the assistant role, no content yet."""
        return self._chunk(index, {"role": "assistant", "content": ""}, None)

    def text_chunk(self, text: str, logprobs: dict[str, Any] | None = None, index: int = 0) -> bytes:
        return self._chunk(index, {"content": text} if self.chat else text, None, logprobs)

    def reasoning_chunk(self, text: str, index: int = 0) -> bytes:
        """A chat choice's reasoning (`reasoning_content`), as it streams."""
        return self._chunk(index, {"reasoning_content": text}, None)

    def tool_call_chunk(self, piece: dict[str, Any], index: int = 0) -> bytes:
        """A piece of a chat choice's function call (`piece`: an OpenAI `tool_calls` delta entry, its
        `index` the call's number in the choice)."""
        return self._chunk(index, {"tool_calls": [piece]}, None)

    def finish_chunk(self, finish_reason: str, index: int = 0) -> bytes:
        return self._chunk(index, {} if self.chat else "", finish_reason)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        body = self._envelope()
        body.update(choices=[], usage=usage(prompt_tokens, completion_tokens))
        return sse(body)

    def _chunk(
        self,
        index: int,
        delta: dict[str, Any] | str,
        finish_reason: str | None,
        logprobs: dict[str, Any] | None = None,
    ) -> bytes:
        if self.chat:
            choice: dict[str, Any] = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": delta}
        choice.update(finish_reason=finish_reason, logprobs=logprobs)
        body = self._envelope()
        body["choices"] = [choice]
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def _envelope(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
        }
