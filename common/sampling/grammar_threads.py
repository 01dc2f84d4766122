"""GrammarThreads: where a worker's grammars compile, beside its loop (common/sampling/structured.py).

Daemon threads that run the calls given to them in turn, each behind a Future. Not a ThreadPoolExecutor: the
interpreter joins those at its exit, and an xgrammar compile cannot be stopped, so a worker told to stop
would wait for one (a schema past the time budget: a minute). A compile given up on (`give_up`: its request
failed at the time budget) runs on to its end on its thread, and a new thread takes the calls after it, so
that they do not queue behind it; at most SPARE_THREADS such compiles run at once (past them, the calls
queue: structured output slows, nothing else).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

SPARE_THREADS = 2
"""Compiles given up on that may run on, each on its own thread, beside the thread that takes the calls."""


class GrammarThreads:
    """Runs the calls given to it one at a time, in order; one given up on while it runs runs on apart."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._calls: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._given_up: set[Future] = set()
        """Calls given up on that still run: each thread that runs one ends with it."""
        self._start()

    def submit(self, call: Callable[..., Any], *args: Any) -> Future:
        """`call(*args)`'s Future: run after the calls given before it."""
        future: Future = Future()
        self._calls.put((future, call, args))
        return future

    def give_up(self, future: Future) -> None:
        """Nobody waits for `future`'s call any more: where it runs, a new thread takes the next calls (up to
        SPARE_THREADS calls given up on running at once)."""
        with self._lock:
            if not future.running() or future in self._given_up or len(self._given_up) >= SPARE_THREADS:
                return
            self._given_up.add(future)
            self._start()

    @property
    def running_apart(self) -> int:
        """Calls given up on that still run."""
        with self._lock:
            return len(self._given_up)

    def _start(self) -> None:
        threading.Thread(target=self._run, name=self.name, daemon=True).start()

    def _run(self) -> None:
        while True:
            future, call, args = self._calls.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call(*args))
            except BaseException as exc:  # the Future carries it to whoever waits (as an executor's)
                future.set_exception(exc)
            with self._lock:
                if future in self._given_up:  # another thread took the calls meanwhile
                    self._given_up.discard(future)
                    return
