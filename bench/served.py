"""A served stack for the serving benchmarks: `spillway serve` on the embedded tiny model (CPU), in a process
of its own, until the block ends."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from common.ipc.ports import free_ports


@contextmanager
def served(flags: list[str], ready_s: float = 300.0) -> Iterator[tuple[str, int]]:
    """(base URL, router pid) of `spillway serve --threads 1 FLAGS`, healthy; stopped when the block ends."""
    port = free_ports(1)
    cache = tempfile.mkdtemp(prefix="spillway-bench-")
    argv = [sys.executable, "-m", "services.cli", "serve", "--port", str(port), "--threads", "1", *flags]
    server = subprocess.Popen(argv, env={**os.environ, "SPILLWAY_CACHE": cache})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).json().get("status") == "ok":
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        (router,) = [pid for pid, cmd in children(server.pid).items() if "services.router" in cmd]
        yield url, router
    finally:
        server.terminate()
        server.wait(timeout=60)


def children(pid: int) -> dict[int, str]:
    """The processes whose parent is `pid`, with their command lines."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes().decode()
        except (OSError, ValueError):
            continue
    return found
