"""One request's token events turned into text deltas: incremental detokenization, stop strings, limits.

The workers decide `stop` (end-of-sequence / stop tokens) and `length`; the router adds `stop` for stop
strings (which only it can see, on the text) and enforces `max_tokens` itself as well, so a worker that
overruns cannot make a client receive more than it asked for. `error` becomes an ApiError (500; 400 where
the workers refused the request itself: `Tokens.refused`) and a worker-initiated `abort` one of 503: neither
is a finish reason a client ever sees.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.openai.api import ApiError, GenerationSpec, bad_request
from common.protocol import TokenLogprobs, Tokens
from common.text.detokenize import IncrementalDetokenizer, StopStrings
from common.text.tokenizer import Tokenizer
from services.router.core import Flight
from services.router.logprobs import TokenChoice


@dataclass(frozen=True)
class Delta:
    """New text for the client; `finish_reason` is set on the last one (stop | length)."""

    text: str
    finish_reason: str | None = None
    logprobs: tuple[TokenChoice, ...] = ()
    """The log-probabilities of the tokens this delta counts (those the request asked for)."""


class TextGeneration:
    """Reads a flight's events and returns what the client may see, one event at a time."""

    def __init__(self, flight: Flight, tokenizer: Tokenizer, spec: GenerationSpec) -> None:
        """`flight` read as its request `spec` asks: its stop strings and its limit."""
        self.flight = flight
        self.max_tokens = flight.sampling.max_tokens if spec.max_tokens is None else spec.max_tokens
        """The most tokens the client gets (the workers' limit, or less: a prompt only scored gets none)."""
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stops = StopStrings(spec.stop, spec.kept_stop)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.text = ""
        """Everything returned so far."""
        self.logprobs: list[TokenChoice] = []
        """The log-probabilities of every counted token so far (when the request asked for them)."""
        self.prompt_logprobs: list[TokenLogprobs] = []
        """Those of the prompt's tokens after the first (an echo that asked for them: prefill's event)."""

    @property
    def prompt_tokens(self) -> int:
        return len(self.flight.prompt_ids)

    async def next(self) -> Delta:
        """The next delta (possibly empty text); raises ApiError if the workers failed the request."""
        assert self.finish_reason is None, "the generation is over"
        event = await self.flight.next_event()
        if event.finish_reason == "error" and event.refused:
            raise bad_request(event.error or "The workers refused the request.", code="refused")
        if event.finish_reason == "error":
            raise ApiError(
                500,
                f"Generation failed: {event.error or 'worker error'}",
                type="server_error",
                code="worker_error",
            )
        if event.finish_reason == "abort":
            raise ApiError(
                503, "The request was aborted by a worker.", type="server_error", code="worker_abort"
            )
        self.prompt_logprobs += event.prompt_logprobs
        text, finish, counted = self._apply(event)
        choices = tuple(zip(event.token_ids[:counted], event.logprobs[:counted], strict=False))
        self.text += text
        self.logprobs += choices
        self.finish_reason = finish
        return Delta(text, finish, choices)

    def _apply(self, event: Tokens) -> tuple[str, str | None, int]:
        """The event's new text, the finish reason, and how many of its tokens the completion counts."""
        ids = event.token_ids
        finish = event.finish_reason
        room = self.max_tokens - self.completion_tokens
        if len(ids) >= room and finish is None:
            finish = "length"  # the worker overran (or will say so next); the router ends it here
        ids = ids[:room]
        text, counted = "", 0
        # With stop strings, token by token: the tokens after the one that completes a stop string are
        # not part of the completion (nor of its usage).
        for chunk in [[i] for i in ids] if self._stops.active else [ids]:
            counted += len(chunk)
            text += self._stops.push(self._detok.push(chunk))
            if self._stops.matched is not None:
                break
        self.completion_tokens += counted
        if self._stops.matched is not None:
            return text, "stop", counted
        if finish is None:
            return text, None, counted
        text += self._stops.push(self._detok.flush())
        if self._stops.matched is not None:
            return text, "stop", counted
        return text + self._stops.flush(), finish, counted
