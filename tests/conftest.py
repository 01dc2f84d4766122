"""Shared test setup: offline HF, deterministic CPU math; Triton's interpreter without CUDA."""

from __future__ import annotations

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    # Triton kernels run in its interpreter (same semantics, numpy underneath). The switch is read when
    # triton is first imported, which any test module may do indirectly (compressed-tensors does): so here,
    # before any test module is collected.
    os.environ["TRITON_INTERPRET"] = "1"


# -- `spillway serve` as a real process (tests/services, tests/gpu) ---------------------------------------

import contextlib
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest

from common.ipc.ports import free_ports


def free_port() -> int:
    return free_ports(1)


def health(port: int) -> tuple[int, dict]:
    """(status, body) of GET /health; (0, {}) when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
    except OSError:
        return 0, {}


def wait_healthy(port: int, timeout_s: float = 300, proc: subprocess.Popen | None = None) -> dict:
    """The /health body once it is a 200 (fails at once if `proc`, the server, exits first)."""
    deadline, body = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        assert proc is None or proc.poll() is None, f"the server exited with {proc.returncode}"
        status, body = health(port)
        if status == 200:
            return body
        time.sleep(0.3)
    raise AssertionError(f"not healthy after {timeout_s} s: {body}")


def wait_status(server: Server, status: str, timeout_s: float = 60) -> dict:
    """The /health body once its status is `status` (fails at once if the launcher exits)."""
    deadline, body = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        assert server.proc.poll() is None, f"spillway serve exited with {server.proc.returncode}"
        body = health(server.port)[1]
        if body.get("status") == status:
            return body
        time.sleep(0.2)
    raise AssertionError(f"not {status} after {timeout_s} s: {body}")


@contextlib.contextmanager
def class_patched(owner: type, **attrs: object):
    """Set `attrs` on class `owner` for the block, then put the class back as it was: an attribute it only
    inherited is deleted, not set to the inherited value (pytest's monkeypatch sets it, and a slot such as
    torch.Tensor.__getitem__ defined on the subclass changes how CPython and torch treat every tensor)."""
    own = {name: owner.__dict__[name] for name in attrs if name in owner.__dict__}
    for name, value in attrs.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name in attrs:
            if name in own:
                setattr(owner, name, own[name])
            else:
                delattr(owner, name)


@dataclass
class Server:
    proc: subprocess.Popen
    port: int

    def client(self):
        import openai

        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


@pytest.fixture
def start_server():
    """start_server(*serve_args, env=...) → a healthy Server (`spillway serve` on a free port); stops it."""
    started: list[Server] = []

    def start(*args: str, env: dict | None = None) -> Server:
        port = free_port()
        argv = [sys.executable, "-m", "services.cli", "serve", "--port", str(port), *args]
        server = Server(subprocess.Popen(argv, env={**os.environ, **(env or {})}), port)
        started.append(server)
        wait_healthy(port, proc=server.proc)
        return server

    yield start
    for server in started:
        server.stop()
