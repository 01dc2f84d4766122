"""What a streamed request sends, event by event, in each API's form: `ChatEvents` for chat and text
completions (chunks ending in `[DONE]`), `ResponseEvents` for the Responses API. The app's one stream loop
(app.Router._events) reads the choices and asks the form for the bytes of each step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from common.openai.api import ApiError
from services.router.choices import Choice, Choices
from services.router.generation import Delta
from services.router.responses import DONE, ResponseBuilder, sse
from services.router.responses_api import ResponseStream


class StreamEvents(Protocol):
    """The bytes a stream sends: before the first delta, for each delta, after the last, on failure."""

    def opening(self, choices: Choices) -> list[bytes]: ...

    def delta(self, choice: Choice, delta: Delta) -> list[bytes]: ...

    def closing(self, choices: Choices) -> list[bytes]: ...

    def failure(self, error: ApiError) -> list[bytes]: ...


@dataclass
class ChatEvents:
    """Chat and text completion chunks: each chat choice opens with its role (a completion with its echo),
    then its reasoning, content and call pieces as they come; usage last where asked, then `[DONE]`."""

    builder: ResponseBuilder

    def opening(self, choices: Choices) -> list[bytes]:
        out = []
        for choice in choices.items:
            if self.builder.chat:
                out.append(self.builder.role_chunk(choice.index))
            if choice.echo is not None:
                out.append(self.builder.text_chunk(*choice.echoed(), choice.index))
        return out

    def delta(self, choice: Choice, delta: Delta) -> list[bytes]:
        reasoning, content, calls, finish = choice.streamed(delta)
        out = []
        if reasoning:
            out.append(self.builder.reasoning_chunk(reasoning, choice.index))
        if content or (choice.logprobs is not None and delta.logprobs):
            out.append(self.builder.text_chunk(content, choice.rendered(delta), choice.index))
        out += [self.builder.tool_call_chunk(piece.as_openai(), choice.index) for piece in calls]
        if finish is not None:
            out.append(self.builder.finish_chunk(finish, choice.index))
        return out

    def closing(self, choices: Choices) -> list[bytes]:
        if not self.builder.include_usage:
            return [DONE]
        return [self.builder.usage_chunk(choices.prompt_tokens, choices.completion_tokens), DONE]

    def failure(self, error: ApiError) -> list[bytes]:
        return [sse(error.body()), DONE]


@dataclass
class ResponseEvents:
    """The Responses API's events for a request's one choice (services/router/responses_api.py);
    `count_tokens` gives the reasoning's tokens for the usage."""

    stream: ResponseStream
    count_tokens: Callable[[str], int]

    def opening(self, choices: Choices) -> list[bytes]:
        return self.stream.start()

    def delta(self, choice: Choice, delta: Delta) -> list[bytes]:
        reasoning, content, calls, finish = choice.streamed(delta)
        rendered = choice.rendered(delta)
        out = self.stream.push(reasoning, content, None if rendered is None else rendered["content"], calls)
        if finish is None:
            return out
        gen = choice.gen
        assert gen is not None
        counts = (gen.prompt_tokens, gen.completion_tokens, self.count_tokens(self.stream.reasoning))
        return out + self.stream.finish(finish, *counts)

    def closing(self, choices: Choices) -> list[bytes]:
        return []

    def failure(self, error: ApiError) -> list[bytes]:
        return self.stream.fail(error)
