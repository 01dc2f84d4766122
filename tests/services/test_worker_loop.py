"""services/worker_loop.py: the hang watchdog of a worker (no launcher needed to end a hung worker), and
sends to a router that does not read."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.ipc.transport import Inbox, ipc_address
from common.protocol import Abort, Heartbeat, Tokens
from services.parent_watch import PARENT_GONE_GRACE_S, PARENT_PID_ENV
from services.worker_loop import HEARTBEAT_S, WorkerShell

SCRIPT = """
import sys, time
from common.ipc.transport import ipc_address
from services.worker_loop import HANG_EXIT_GRACE_S, WorkerShell

run = sys.argv[1]
shell = WorkerShell("decode", ipc_address(run, "decode"), {{"router": ipc_address(run, "router")}},
                    stall_timeout_s=1.0)
time.sleep(1.5)  # start-up is not timed
shell.ready(1, 16)
for _ in range({beats}):
    time.sleep(0.4)
    shell.heartbeat()
{then}
shell.close()
print("alive", flush=True)
"""


def _run(beats: int, then: str, run_dir: Path) -> subprocess.CompletedProcess:
    code = SCRIPT.format(beats=beats, then=then)
    argv = [sys.executable, "-c", code, str(run_dir)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_a_loop_stuck_past_the_stall_timeout_ends_the_process_with_its_stacks(tmp_path: Path) -> None:
    start = time.monotonic()
    run = _run(beats=3, then="time.sleep(30)  # a step that never returns", run_dir=tmp_path)
    assert run.returncode != 0 and "alive" not in run.stdout
    assert "Timeout" in run.stderr and 'File "<string>"' in run.stderr, "the stuck thread's stack, dumped"
    assert time.monotonic() - start < 25  # 1 s + HANG_EXIT_GRACE_S after the last beat


def test_heartbeats_keep_it_alive_and_close_disarms_it(tmp_path: Path) -> None:
    run = _run(beats=14, then="shell.close(); time.sleep(1 + HANG_EXIT_GRACE_S + 1)", run_dir=tmp_path)
    assert run.returncode == 0 and "alive" in run.stdout, run.stderr


def test_a_router_that_does_not_read_never_blocks_the_loop(tmp_path: Path) -> None:
    """Nobody reads the router's inbox (hung, or restarting): past ZeroMQ's queue the events are dropped
    and counted, and the worker's loop goes on (a blocked send would stall every lane and the heartbeats)."""
    shell = WorkerShell(
        "decode", ipc_address(tmp_path, "decode"), {"router": ipc_address(tmp_path, "router")}
    )
    try:
        start = time.monotonic()
        for i in range(5000):
            shell.send("router", Tokens(f"r{i}", [1, 2, 3], index=0))
        assert time.monotonic() - start < 10
        assert 0 < shell.router_dropped < 5000, "the queue holds some, the rest are dropped"
    finally:
        shell.close()


def test_a_request_that_lost_events_is_aborted_and_failed_once_the_router_reads(tmp_path: Path) -> None:
    """A dropped event would leave its request waiting at the router for good (it orders events by index):
    the worker aborts it (an Abort from `receive`) and sends an error event for it, once, when the router
    reads again; requests whose events all went through are untouched."""
    shell = WorkerShell(
        "decode", ipc_address(tmp_path, "decode"), {"router": ipc_address(tmp_path, "router")}
    )
    try:
        for i in range(3000):  # one event a request, past the queue
            shell.send("router", Tokens(f"r{i}", [1], index=0))
        assert shell.router_dropped > 0
        lost = {f"r{i}" for i in range(3000 - shell.router_dropped, 3000)}
        aborts = shell.receive(busy=True)
        assert {m.rid for m in aborts if isinstance(m, Abort)} == lost
        assert shell.receive(busy=True) == []  # aborted once
        router = Inbox(ipc_address(tmp_path, "router"))  # the router reads again
        try:
            events, deadline = [], time.monotonic() + 10
            while (
                len([e for e in events if e.finish_reason == "error"]) < len(lost)
                and time.monotonic() < deadline
            ):
                shell.receive(busy=True)  # each turn of the loop delivers what the router's queue takes
                events += router.drain()
                time.sleep(0.01)
            errors = [e for e in events if isinstance(e, Tokens) and e.finish_reason == "error"]
            assert sorted(e.rid for e in errors) == sorted(lost) and all("lost" in e.error for e in errors)
            shell.send("router", Tokens(next(iter(lost)), [2], index=1))  # a late one: no second error
            shell.receive(busy=True)
            time.sleep(0.1)
            assert not [e for e in router.drain() if isinstance(e, Tokens) and e.finish_reason == "error"]
        finally:
            router.close()
    finally:
        shell.close()


ORPHAN = """
import os, sys, time
from common.ipc.transport import ipc_address
from services.worker_loop import HEARTBEAT_S, WorkerShell

run = sys.argv[1]
shell = WorkerShell("decode", ipc_address(run, "decode"), {}, exit_with_parent=True)
print(os.getpid(), flush=True)
start = time.monotonic()
while not shell.stopping and time.monotonic() - start < 30:
    time.sleep(0.05)
shell.close()
print("stopped" if shell.stopping else "still running", flush=True)
"""

LOADING = """
import os, sys, time
from common.ipc.transport import ipc_address
from services.worker_loop import HEARTBEAT_S, WorkerShell

shell = WorkerShell("decode", ipc_address(sys.argv[1], "decode"), {}, exit_with_parent=True)
print(os.getpid(), flush=True)
time.sleep(60)  # loading the model: no loop to stop
print("still running", flush=True)
"""


@pytest.mark.parametrize(("script", "last"), [(ORPHAN, "stopped"), (LOADING, "")])
def test_a_worker_started_to_exit_with_its_parent_stops_when_the_parent_is_killed(
    tmp_path: Path, script: str, last: str
) -> None:
    """A supervisor SIGKILLed (a Ray actor) cannot stop its children: they notice it gone and stop, from their
    loop or, where none runs (loading the model), by ending the process."""
    out = tmp_path / "out.txt"
    parent = (
        "import subprocess, sys, time\n"
        f"argv = [sys.executable, '-c', {script!r}, {str(tmp_path)!r}]\n"
        f"subprocess.Popen(argv, stdout=open({str(out)!r}, 'w'))\n"
        "time.sleep(60)\n"
    )
    printed = lambda: out.read_text() if out.exists() else ""
    proc = subprocess.Popen([sys.executable, "-c", parent])
    deadline = time.monotonic() + 30
    while not printed().strip() and time.monotonic() < deadline:  # the worker is up
        time.sleep(0.1)
    child = int(printed().split()[0])
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 5 + PARENT_GONE_GRACE_S
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), printed()
    assert printed().split()[1:] == ([last] if last else []), printed()


def test_a_worker_whose_supervisor_died_before_it_looked_stops(tmp_path: Path) -> None:
    """The supervisor's pid comes in the environment (Child.start): a worker whose supervisor was killed
    while it imported (now under init) still sees it gone, where os.getppid() would have given init's pid."""
    gone = subprocess.Popen(["true"])
    gone.wait()  # a supervisor that is no more
    env = {**os.environ, PARENT_PID_ENV: str(gone.pid)}
    argv = [sys.executable, "-c", ORPHAN, str(tmp_path)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    assert done.stdout.split()[1:] == ["stopped"], done.stderr


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_long_work_goes_on_heartbeating(tmp_path) -> None:
    """`working`: heartbeats from a thread of their own while the loop is busy with one long piece of work."""
    router = Inbox(ipc_address(tmp_path, "router"))
    shell = WorkerShell("encoder", ipc_address(tmp_path, "encoder"), {"router": router.address})
    try:
        shell.ready(64, 0, 100)
        assert router.recv(timeout_ms=2000).image_tokens == 100
        with shell.working(running=1, waiting=2):
            time.sleep(2.5 * HEARTBEAT_S)
        beats = router.drain()
        assert len(beats) >= 2 and all(isinstance(b, Heartbeat) for b in beats)
        assert (beats[0].running, beats[0].waiting, beats[0].image_tokens) == (1, 2, 100)
    finally:
        shell.close()
        router.close()


def test_heartbeats_go_on_while_a_step_holds_the_loop_and_tell_its_silence(tmp_path) -> None:
    """The beats come from a thread of their own: a long step (torch ops, then pure Python holding the GIL
    in turns) delays none of them; each says how long the loop has not come round (`Heartbeat.loop_s`)."""
    import torch

    router = Inbox(ipc_address(tmp_path, "router"))
    shell = WorkerShell("decode", ipc_address(tmp_path, "decode"), {"router": router.address})
    try:
        shell.ready(4, 64)
        shell.heartbeat(running=3, waiting=1)
        assert router.recv(timeout_ms=2000) is not None  # the Ready
        start = time.monotonic()
        a = torch.randn(256, 256)
        while time.monotonic() - start < 1.6 * HEARTBEAT_S:
            a = torch.tanh(a @ a)
        while time.monotonic() - start < 3.2 * HEARTBEAT_S:
            sum(i * i for i in range(10_000))
        beats = router.drain()
        assert len(beats) >= 2 and all(isinstance(b, Heartbeat) for b in beats)
        assert (beats[-1].running, beats[-1].waiting) == (3, 1)
        assert beats[-1].loop_s > 1.5 * HEARTBEAT_S, "the loop has not come round since"
        shell.heartbeat()
        assert router.recv(timeout_ms=int(2000 * HEARTBEAT_S)).loop_s < HEARTBEAT_S
    finally:
        shell.close()
        router.close()
