"""services/worker_loop.py: the hang watchdog of a worker (no launcher needed to end a hung worker)."""

from __future__ import annotations

import subprocess
import sys
import time

SCRIPT = """
import sys, time
from common.transport import ipc_address, make_run_dir
from services.worker_loop import WorkerShell

run = make_run_dir()
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


def _run(beats: int, then: str) -> subprocess.CompletedProcess:
    code = SCRIPT.format(beats=beats, then=then)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_a_loop_stuck_past_the_stall_timeout_ends_the_process_with_its_stacks() -> None:
    start = time.monotonic()
    run = _run(beats=3, then="time.sleep(30)  # a step that never returns")
    assert run.returncode != 0 and "alive" not in run.stdout
    assert "Timeout" in run.stderr and 'File "<string>"' in run.stderr, "the stuck thread's stack, dumped"
    assert time.monotonic() - start < 20


def test_heartbeats_keep_it_alive_and_close_disarms_it() -> None:
    run = _run(beats=6, then="shell.close(); time.sleep(1.5)")
    assert run.returncode == 0 and "alive" in run.stdout, run.stderr
