"""GrammarWaits: a worker's requests that wait for their grammar's compile (structured output), in a queue of
their own, so that the worker's loop never waits for one: it steps the other requests and asks, each turn,
which of these may go on (`settle`).

A form over the size budget fails its request at once, uncompiled; a request whose compile has not ended
within the time budget fails then (the compile runs on, xgrammar's cannot be stopped, but the next ones do
not queue behind it: common/sampling/grammar_threads.py). Both failures are the request's own
(`GrammarFailure.refused`: the router answers 400); a compile that raised is a failure of the worker's (500).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, TypeVar

from common.protocol import SamplingParams
from common.sampling.logit_processors import LogitProcessors
from common.sampling.structured import size_refusal

T = TypeVar("T")


@dataclass(frozen=True)
class GrammarFailure:
    """Why a request cannot start: its `error` message, and whether the request itself is at fault
    (`refused`: over a budget) rather than the worker."""

    error: str
    refused: bool


@dataclass
class _Wait(Generic[T]):
    item: T
    form: Future | None
    """The compile (`LogitProcessors.prepare`); None: no grammar to wait for."""
    deadline: float
    failure: GrammarFailure | None = None


class GrammarWaits(Generic[T]):
    """Requests (`T`: what the worker holds of each) by id, in arrival order, each until its grammar has
    compiled or failed; one with no grammar goes on at the next `settle`."""

    def __init__(
        self,
        processors: LogitProcessors,
        max_bytes: int,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`max_bytes`, `timeout_s`: the budgets (WorkerConfig.grammar_max_bytes, .grammar_timeout_s)."""
        self.processors, self.max_bytes, self.timeout_s, self.clock = processors, max_bytes, timeout_s, clock
        self._waits: dict[str, _Wait[T]] = {}

    def add(self, rid: str, item: T, params: SamplingParams) -> None:
        """Hold `item` (request `rid`, sampled with `params`) until its grammar is ready; its compile starts
        now (on the grammars' thread), unless its form is over the size budget."""
        refusal = size_refusal(params.structure, self.max_bytes) if params.structure else None
        form = None if refusal is not None else self.processors.prepare(params)
        failure = None if refusal is None else GrammarFailure(refusal, refused=True)
        self._waits[rid] = _Wait(item, form, self.clock() + self.timeout_s, failure)

    def settle(self) -> tuple[list[tuple[str, T, Future | None]], list[tuple[str, T, GrammarFailure]]]:
        """Take out the requests that may go on — (id, item, its compile, done; None: none) in arrival
        order — and those that failed, with why. The others wait on."""
        ready: list[tuple[str, T, Future | None]] = []
        failed: list[tuple[str, T, GrammarFailure]] = []
        now = self.clock()
        for rid, wait in list(self._waits.items()):
            failure = wait.failure or self._failure(wait, now)
            if failure is not None:
                failed.append((rid, wait.item, failure))
            elif wait.form is None or wait.form.done():
                ready.append((rid, wait.item, wait.form))
            else:
                continue
            del self._waits[rid]
        return ready, failed

    def _failure(self, wait: _Wait[T], now: float) -> GrammarFailure | None:
        """A compile that raised, or one still running past the request's deadline; None otherwise."""
        form = wait.form
        if form is not None and form.done():
            exc = form.exception()
            return None if exc is None else GrammarFailure(f"its grammar did not compile: {exc}", False)
        if form is not None and now > wait.deadline:
            self.processors.give_up(form)  # (it runs on: the compiles after it go on apart from it)
            return GrammarFailure(
                f"The structured output's grammar did not compile within {self.timeout_s:g} s "
                "(--grammar-timeout): a simpler schema compiles faster.",
                refused=True,
            )
        return None

    def drop(self, rid: str) -> T | None:
        """Forget `rid` (aborted): its item, or None where it does not wait here."""
        wait = self._waits.pop(rid, None)
        return None if wait is None else wait.item

    def clear(self) -> None:
        self._waits.clear()

    def held(self) -> list[T]:
        """Every waiting item, in arrival order."""
        return [wait.item for wait in self._waits.values()]

    def __contains__(self, rid: object) -> bool:
        return rid in self._waits

    def __len__(self) -> int:
        return len(self._waits)

    def __iter__(self) -> Iterator[str]:
        return iter(self._waits)
