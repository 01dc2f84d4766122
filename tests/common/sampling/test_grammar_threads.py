"""GrammarThreads: calls run in order behind Futures; a call given up on runs on apart while a new thread
takes the next ones (at most SPARE_THREADS at once); a process never waits for a call still running when
it exits."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from common.sampling.grammar_threads import SPARE_THREADS, GrammarThreads


def _threads(name: str) -> int:
    return sum(t.name == name for t in threading.enumerate())


def test_calls_run_in_order_and_their_futures_carry_results_and_errors():
    threads = GrammarThreads("order")
    seen: list[int] = []
    futures = [threads.submit(seen.append, i) for i in range(5)]
    failed = threads.submit(lambda: 1 / 0)
    assert [f.result(timeout=5) for f in futures] == [None] * 5 and seen == [0, 1, 2, 3, 4]
    with pytest.raises(ZeroDivisionError):
        failed.result(timeout=5)


def test_a_call_given_up_on_runs_on_apart_and_the_next_do_not_wait_for_it():
    threads = GrammarThreads("apart")
    gates = [threading.Event() for _ in range(SPARE_THREADS + 1)]
    held = [threads.submit(gate.wait, 30) for gate in gates]
    after = threads.submit(lambda: "next")
    try:
        for future in held:  # each in turn: running, given up on, and the next runs on a new thread
            deadline = time.monotonic() + 5
            while not future.running():
                assert time.monotonic() < deadline
                time.sleep(0.01)
            threads.give_up(future)
        assert threads.running_apart == SPARE_THREADS  # the last held one was not let go: at the cap
        assert not after.done()
        gates[-1].set()
        assert after.result(timeout=5) == "next"
    finally:
        for gate in gates:
            gate.set()
    deadline = time.monotonic() + 5
    while threads.running_apart or _threads("apart") != 1:  # the threads given up on ended with their calls
        assert time.monotonic() < deadline, (threads.running_apart, _threads("apart"))
        time.sleep(0.01)
    assert threads.submit(lambda: 7).result(timeout=5) == 7


def test_a_process_does_not_wait_for_a_running_call_at_its_exit():
    code = (
        "import time; from common.sampling.grammar_threads import GrammarThreads; "
        "f = GrammarThreads('g').submit(time.sleep, 60)\n"
        "while not f.running(): time.sleep(0.01)"
    )
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
    assert time.monotonic() - started < 20
