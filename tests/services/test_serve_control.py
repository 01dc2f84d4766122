"""`spillway serve`'s control plane end to end: forged and garbage frames sent to the router's and a worker's
inbox reach nothing (refused, logged and counted; no service restarted, nothing failed), the keys are on no
command line, and a prefill worker killed while requests decode fails none of them."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import zmq

from common.ipc.keys import KEYS_ENV, ControlKeys
from common.ipc.transport import ipc_address
from common.protocol import Heartbeat, ServiceDown, encode
from tests.conftest import free_ports, health, wait_healthy

pytestmark = pytest.mark.slow
MODEL = "tiny-qwen3_moe"
TOKENS = 400
"""Long enough that the requests still decode while prefill is killed and restarted."""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A served tiny model with metrics ports (the router's, then prefill's and decode's)."""
    import subprocess

    from tests.conftest import Server, free_port

    port, metrics = free_port(), free_ports(4)
    args = ["--threads", "1", "--max-running", "4", "--max-queue", "8", "--metrics-port", str(metrics)]
    argv = [sys.executable, "-m", "services.cli", "serve", "--port", str(port), *args]
    env = {**os.environ, "SPILLWAY_CACHE": str(tmp_path_factory.mktemp("cache"))}
    server = Server(subprocess.Popen(argv, env=env), port)
    try:
        wait_healthy(port)
        yield server, metrics
    finally:
        server.stop()


def _run_dir(launcher_pid: int) -> Path:
    for path in Path("/tmp").glob("spillway-*"):
        owner = path / "launcher.pid"
        if owner.exists() and owner.read_text() == str(launcher_pid):
            return path
    raise AssertionError("no run directory of the launcher")


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def _refused(text: str) -> float:
    match = re.search(r'spillway:control_refused_total\{reason="handshake"\} ([0-9.e+]+)', text)
    return float(match.group(1)) if match else 0.0


def _stream(client, tokens: int, out: list, started: threading.Semaphore | None = None) -> None:
    """Stream a completion of `tokens` tokens (releasing `started` at its second chunk: decode's); append
    (tokens generated, time.monotonic() at its end), or the exception it raised."""
    try:
        stream = client.completions.create(
            model=MODEL,
            prompt="go",
            max_tokens=tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = []
        for i, chunk in enumerate(stream):
            if i == 1 and started is not None:
                started.release()
            if chunk.usage is not None:
                usage.append(chunk.usage)
        out.append((usage[-1].completion_tokens, time.monotonic()))
    except Exception as exc:  # (the test asserts there is none)
        out.append(exc)


def test_forged_and_garbage_frames_reach_nothing(served) -> None:
    server, metrics = served
    before = health(server.port)[1]["services"]
    run_dir = _run_dir(server.proc.pid)
    done: list = []
    streaming = threading.Thread(target=_stream, args=(server.client(), 60, done))
    streaming.start()
    ctx = zmq.Context()
    try:
        for service, frames in (
            ("router", [encode(ServiceDown("decode", before["decode"]["pid"], -9)),
                        encode(Heartbeat("decode", 1)), b"\x00garbage"]),
            ("decode", [b"\x00garbage"]),
        ):  # fmt: skip
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(ipc_address(run_dir, service))
            for frame in frames:
                push.send(frame)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (
            _refused(_scrape(server.port)) and _refused(_scrape(metrics + 2))
        ):
            time.sleep(0.2)
        assert _refused(_scrape(server.port)) >= 1, "the router counted the refused connection"
        assert _refused(_scrape(metrics + 2)) >= 1, "so did decode"
    finally:
        ctx.destroy(0)
    streaming.join(timeout=120)
    assert done and not isinstance(done[0], Exception) and done[0][0] == 60, done
    after = health(server.port)[1]["services"]
    for name in ("prefill", "decode"):
        assert (after[name]["pid"], after[name]["restarts"]) == (before[name]["pid"], 0)
        assert after[name]["state"] == "up"


def test_the_keys_are_in_no_command_line(served) -> None:
    server, _ = served
    pids = [svc["pid"] for svc in health(server.port)[1]["services"].values()]
    for pid in pids:
        environ = dict(
            item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item
        )
        secret = ControlKeys.from_json(environ[KEYS_ENV]).secret.decode()
        for other in Path("/proc").glob("[0-9]*"):
            try:
                assert secret not in (other / "cmdline").read_text()
            except OSError:
                continue


def test_a_killed_prefill_worker_spares_the_requests_decode_holds(served) -> None:
    """kill -9 of prefill while four requests decode: they all finish, and serving resumes."""
    server, _ = served
    client = server.client()
    old = health(server.port)[1]["services"]["prefill"]["pid"]
    done: list = []
    started = threading.Semaphore(0)
    threads = [threading.Thread(target=_stream, args=(client, TOKENS, done, started)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for _ in threads:
        assert started.acquire(timeout=60)
    os.kill(old, signal.SIGKILL)
    killed = time.monotonic()
    for thread in threads:
        thread.join(timeout=180)
    assert len(done) == 4 and all(not isinstance(d, Exception) for d in done), done
    assert all(tokens == TOKENS and end > killed for tokens, end in done), (done, killed)
    assert wait_healthy(server.port)["services"]["prefill"]["pid"] != old
    r = client.completions.create(model=MODEL, prompt="again", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4
