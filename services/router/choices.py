"""A request's `n` choices: a generation each (its own flight at the workers), started together and read as
one.

Each choice is a request of its own to the workers, in its own admission slot. A prompt's choices share
its prefill where they can (`RouterCore.max_group`: decode grants their lanes together): they are admitted
together, prefill runs the prompt once and samples each one's first token, decode copies the prompt's
state to each. Past that, each choice is admitted, prefilled and decoded on its own. Choice i samples with
the request's seed + i, so that seeded choices differ from each other and each is reproducible; without a
seed each draws its own. Either every choice starts or none stays: a choice refused at admission (429, 503)
or failed before its first token closes the others.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from common.openai.api import INT64_MIN, GenerationSpec, bad_request
from common.openai.reasoning import ReasoningStream, split_reasoning
from common.openai.tool_calls import CallDelta, ToolCallStream, split_tool_calls
from common.protocol import SamplingParams
from common.text.tokenizer import Tokenizer
from services.router.core import RouterCore
from services.router.generation import Delta, TextGeneration
from services.router.logprobs import LogprobText
from services.router.responses import ChoiceResult


@dataclass
class Choice:
    """One of a request's choices: its generation (once admitted), its first delta, its logprob renderer
    and the reader of its function calls (None: the request gave no tools)."""

    index: int
    spec: GenerationSpec
    """Its prompt's request (a batched completion has one a prompt)."""
    draw: int
    """Its number among its prompt's `n` choices: it samples at the seed + draw."""
    logprobs: LogprobText | None
    calls: ToolCallStream | None
    echo: str | None = None
    """A text completion's prompt, echoed before its text."""
    reasoning: ReasoningStream | None = None
    """The reader of its reasoning (None: the model's template has none)."""
    first: asyncio.Future[Delta] = field(default_factory=asyncio.Future)
    gen: TextGeneration | None = None

    def echoed(self) -> tuple[str, dict[str, Any] | None]:
        """The echo as a stream opens with it: the prompt's text and (asked for) its log-probabilities."""
        gen = self.gen
        assert self.echo is not None and gen is not None, "no echo, or not started"
        if self.logprobs is None:
            return self.echo, None
        return self.echo, self.logprobs.render_prompt(gen.flight.prompt_ids, gen.prompt_logprobs)

    def rendered(self, delta: Delta) -> dict[str, Any] | None:
        """`delta`'s log-probabilities as a chunk carries them, None when the request asked for none."""
        return None if self.logprobs is None else self.logprobs.render(delta.logprobs)

    def streamed(self, delta: Delta) -> tuple[str, str, list[CallDelta], str | None]:
        """`delta` as a stream shows it: its reasoning, its content (less any function calls), the pieces of
        calls it writes, and its finish reason ("tool_calls" for a choice that called any and stopped)."""
        reasoning, text, done = "", delta.text, delta.finish_reason is not None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.push(text)
            if done:
                more, rest = self.reasoning.flush()
                reasoning, text = reasoning + more, text + rest
        if self.calls is None:
            return reasoning, text, [], delta.finish_reason
        content, pieces = self.calls.push(text)
        if delta.finish_reason is None:  # (not done)
            return reasoning, content, pieces, None
        rest, last = self.calls.flush()
        return reasoning, content + rest, pieces + last, _finish(delta.finish_reason, len(self.calls.calls))

    def result(self) -> ChoiceResult:
        """The finished choice's text (less its calls), finish reason, log-probabilities and calls."""
        gen = self.gen
        assert gen is not None and gen.finish_reason is not None, "the choice has not finished"
        if self.echo is not None:  # a text completion's: nothing else applies
            text, echoed = self.echoed()
            if echoed is None:
                return ChoiceResult(text + gen.text, gen.finish_reason)
            assert self.logprobs is not None  # (echoed log-probabilities: they were asked for)
            generated = self.logprobs.render(gen.logprobs)
            return ChoiceResult(
                text + gen.text, gen.finish_reason, {k: v + generated[k] for k, v in echoed.items()}
            )
        logprobs = None if self.logprobs is None else self.logprobs.render(gen.logprobs)
        reasoning, text = None, gen.text
        if self.reasoning is not None:
            reasoning, text = split_reasoning(text, self.reasoning.form)
        if self.calls is None:
            return ChoiceResult(text, gen.finish_reason, logprobs, reasoning=reasoning)
        content, calls = split_tool_calls(text, self.calls.form)
        message = content if content.strip() or not calls else None
        listed = [call.as_openai() for call in calls] or None
        finish = _finish(gen.finish_reason, len(calls))
        return ChoiceResult(message, finish, logprobs, listed, reasoning)


def _sampling(choice: Choice) -> SamplingParams:
    """A choice's sampling: its prompt's, at the seed + its draw (wrapping within int64)."""
    sampling = choice.spec.sampling
    if sampling.seed is None or choice.draw == 0:
        return sampling
    seed = (sampling.seed + choice.draw - INT64_MIN) % (1 << 64) + INT64_MIN
    return msgspec.structs.replace(sampling, seed=seed)


def _finish(reason: str, calls: int) -> str:
    """A chat's finish reason: "tool_calls" where it called functions and stopped."""
    return "tool_calls" if calls and reason == "stop" else reason


class Choices:
    """Starts, reads and releases the choices of one request: `spec.n` of them for each of its specs (a
    batched text completion has one a prompt), numbered in that order.

    Each choice runs in a task of its own from admission to its last token, which frees its slot at once:
    a request whose choices outnumber the free slots does not wait on itself."""

    def __init__(
        self, core: RouterCore, tokenizer: Tokenizer, specs: list[GenerationSpec], chat: bool
    ) -> None:
        self.core, self.tokenizer, self.specs = core, tokenizer, specs
        self.items: list[Choice] = []
        for spec in specs:
            for draw in range(spec.n):
                renderer = None
                if spec.sampling.logprobs is not None:
                    renderer = LogprobText(tokenizer, chat, spec.tokens_as_ids)
                calls = None if spec.tool_form is None else ToolCallStream(spec.tool_form)
                reasoning = None if spec.reasoning is None else ReasoningStream(spec.reasoning)
                self.items.append(Choice(len(self.items), spec, draw, renderer, calls, spec.echo, reasoning))
        self._later: asyncio.Queue[tuple[Choice, Delta | Exception]] = asyncio.Queue()
        """Every choice's deltas after its first, as they come (or the error that ended it)."""
        self._tasks: list[asyncio.Future[None]] = []

    async def start(self, rid: str, received: float) -> None:
        """Admit every choice and wait for each one's first delta (so that early errors get a proper
        status); on any failure, or cancellation, close them all and raise."""
        self._check_size()
        self._tasks = [asyncio.ensure_future(self._run(group, rid, received)) for group in self._groups()]
        try:
            firsts = {asyncio.shield(c.first) for c in self.items}
            done, _ = await asyncio.wait(firsts, return_when=asyncio.FIRST_EXCEPTION)
            for future in done:  # the first failure, as soon as it comes (a 429 need not wait for the rest)
                future.result()
        except BaseException:
            self.close()
            raise

    def _check_size(self) -> None:
        """A 400 for more choices than admission ever holds at once (running and queued): such a request
        would fill the queue with itself and be refused as busy, whatever the load."""
        running, queue = self.core.max_running(), self.core.config.max_queue
        if len(self.items) > running + queue:
            prompts = f"{len(self.specs)} prompts × " if len(self.specs) > 1 else ""
            raise bad_request(
                f"This request asks for {len(self.items)} choices ({prompts}n = {self.specs[0].n}); this "
                f"server runs {running} at once and queues {queue} more.",
                "n",
                "too_many_choices",
            )

    def _groups(self) -> list[list[Choice]]:
        """The choices admitted and prefilled together: a prompt's (all of them where they fit one group,
        else each alone, so that a request whose choices outnumber the slots does not wait on itself)."""
        groups: list[list[Choice]] = []
        for spec in self.specs:
            mine = [c for c in self.items if c.spec is spec]
            groups += [mine] if len(mine) <= self.core.max_group() else [[c] for c in mine]
        return groups

    async def _run(self, group: list[Choice], rid: str, received: float) -> None:
        """Admit a group of one prompt's choices, then read each to its end."""
        spec = group[0].spec
        names = [rid if len(self.items) == 1 else f"{rid}-{c.index}" for c in group]
        try:
            samplings = [_sampling(c) for c in group]
            flights = await self.core.submit_group(spec.prompt_ids, samplings, received, names, spec.images)
        except Exception as exc:  # refused: the first delta of each raises it
            for choice in group:
                choice.first.set_exception(exc)
            return
        for choice, flight in zip(group, flights, strict=True):  # now, for `close` to release each
            choice.gen = TextGeneration(flight, self.tokenizer, choice.spec)
        await asyncio.gather(*(self._read(c) for c in group))

    async def _read(self, choice: Choice) -> None:
        """Read `choice`'s generation to its last token, then free its slot."""
        gen = choice.gen
        assert gen is not None, "not admitted"
        try:
            delta = await gen.next()
            choice.first.set_result(delta)
            while delta.finish_reason is None:
                delta = await gen.next()
                self._later.put_nowait((choice, delta))
            self.core.release(gen.flight, gen.finish_reason)
        except Exception as exc:  # the reader raises it
            if choice.first.done():
                self._later.put_nowait((choice, exc))
            else:
                choice.first.set_exception(exc)

    async def deltas(self) -> AsyncIterator[tuple[Choice, Delta]]:
        """Every choice's deltas: the first ones in index order, then the rest as they come, until each has
        finished; raises the first error of any (ApiError for a failed generation)."""
        firsts = [(c, c.first.result()) for c in self.items]
        for choice, delta in firsts:
            yield choice, delta
        open_ = sum(delta.finish_reason is None for _, delta in firsts)
        while open_:
            choice, item = await self._later.get()
            if isinstance(item, Exception):
                raise item
            yield choice, item
            open_ -= item.finish_reason is not None

    async def finish(self) -> None:
        """Read every choice to its end."""
        async for _ in self.deltas():
            pass

    def close(self) -> None:
        """Every choice is over for the router (idempotent): its task stopped, its slot freed, aborted at
        the workers unless they finished it."""
        for task in self._tasks:
            task.cancel()
        for choice in self.items:
            if choice.gen is not None:
                self.core.release(choice.gen.flight, choice.gen.finish_reason)
            if choice.first.done() and not choice.first.cancelled():
                choice.first.exception()  # retrieved: a failure past the first is the reader's to report
            else:
                choice.first.cancel()

    @property
    def prompt_tokens(self) -> int:
        """Each prompt's tokens, once (OpenAI's count), whatever its number of choices."""
        return sum(len(spec.prompt_ids) for spec in self.specs)

    @property
    def completion_tokens(self) -> int:
        return sum(c.gen.completion_tokens for c in self.items if c.gen is not None)

    @property
    def arrival(self) -> float:
        gen = self.items[0].gen
        assert gen is not None, "the choices have not started"
        return gen.flight.arrival

    def results(self) -> list[ChoiceResult]:
        """Each choice's result, once all have finished."""
        return [c.result() for c in self.items]
