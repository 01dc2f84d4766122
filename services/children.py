"""Worker processes under supervision: start, restart on exit (telling the router), stop.

Shared by the local launcher (`services/launch.py`: every service on this machine) and the Ray launcher
(`services/ray_launch.py`: each prefill/decode pair on a node of a Ray cluster).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.ipc import tensors as ipc
from common.ipc.keys import LAUNCHER, ControlKeys, keys_env, make_keys
from common.ipc.transport import Outbox
from common.protocol import ServiceDown
from services.parent_watch import PARENT_PID_ENV, RESTARTS_ENV

log = logging.getLogger("launch")
GRACE_S = 2.0
"""How long a child has between SIGTERM and SIGKILL (a service ends in well under a second: `exit_now`)."""
QUICK_EXIT_S = 60.0
"""A child that exits sooner than this after its start, before it came up, failed at start-up (config,
checkpoint, memory)."""
MAX_QUICK_EXITS = 4
"""Start-up failures in a row after which the launcher gives up instead of restarting forever."""


@dataclass
class Child:
    """One supervised process: its name (a service's), its command line, its CUDA_VISIBLE_DEVICES."""

    name: str
    argv: list[str]
    gpu: str | None = None
    """Its CUDA_VISIBLE_DEVICES (None: the launcher's)."""
    env: dict[str, str] = field(default_factory=dict, repr=False)
    """Environment variables it gets beside the launcher's (secrets: the API key, its control-plane keys
    (`common.ipc.keys.keys_env`); never on its command line)."""
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started: float = 0.0
    quick_exits: int = 0
    came_up: bool = False
    """This start of it served (the supervisor saw it up): an exit now is no start-up failure."""

    def start(self) -> None:
        env = {**os.environ, **self.env, PARENT_PID_ENV: str(os.getpid())}
        if self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.gpu
        self.proc = subprocess.Popen(self.argv, env=env)
        self.started = time.monotonic()
        self.came_up = False
        log.info("started %s (pid %d)", self.name, self.proc.pid)

    def count_exit(self) -> None:
        quick = time.monotonic() - self.started < QUICK_EXIT_S and not self.came_up
        self.quick_exits = self.quick_exits + 1 if quick else 0

    def kill(self, why: str) -> None:
        """SIGKILL a hung child and reap it (`restart_exited` then restarts it)."""
        assert self.proc is not None
        log.error("%s (pid %d) %s: killing it", self.name, self.proc.pid, why)
        self.proc.kill()
        self.proc.wait()


def module_argv(service: str) -> list[str]:
    """The command that runs `services.<service>` with this interpreter."""
    return [sys.executable, "-m", f"services.{service}"]


def worker_argv(role: str, name: str, inbox: str, peer: str, router: str, flags: Sequence[str]) -> list[str]:
    """The command of worker `name` (a `role`, prefill or decode, of a pair): its inbox, its peer's, the
    router's, then `flags` (both workers of a pair take the same)."""
    addresses = ["--name", name, "--inbox", inbox, "--peer", peer, "--router", router]
    return [*module_argv(role), *addresses, *flags]


def restart_exited(children: Sequence[Child], router: Outbox | None) -> Child | None:
    """Restart each child that exited, after telling the router (`ServiceDown`: its requests fail now) and
    sweeping the shared memory it leaves; a router gets every child's restarts so far (`RESTARTS_ENV`).
    Returns the child that keeps failing at start-up (then nothing more is restarted: the caller gives
    up), else None."""
    for child in children:
        if child.proc is None or child.proc.poll() is None:
            continue
        code = child.proc.returncode
        if router is not None and child.name != "router":
            router.send(ServiceDown(child.name, child.proc.pid, code))
        ipc.unlink_stale(child.proc.pid)
        child.count_exit()
        if child.quick_exits >= MAX_QUICK_EXITS:
            log.error("%s failed %d times at start-up (last exit %s): giving up", child.name,
                      child.quick_exits, code)  # fmt: skip
            return child
        log.error("%s exited with %s; restarting", child.name, code)
        child.restarts += 1
        if child.name == "router":  # (last of the children: the workers restarted now are counted)
            child.env = {**child.env, RESTARTS_ENV: json.dumps({c.name: c.restarts for c in children})}
        child.start()
    return None


def hand_keys(children: Sequence[Child], others: Sequence[str] = ()) -> ControlKeys:
    """Make the control plane's keys for `children`, the services named `others` (started elsewhere) and the
    launcher; put each child's in its environment; return the launcher's (it sends `ServiceDown`)."""
    keys = make_keys([*(c.name for c in children), *others, LAUNCHER])
    for child in children:
        child.env = {**child.env, **keys_env(keys[child.name])}
    return keys[LAUNCHER]


def stop_children(children: Sequence[Child]) -> None:
    """SIGTERM every live child, SIGKILL those still alive GRACE_S later; sweep their shared memory."""
    live = [c.proc for c in children if c.proc is not None and c.proc.poll() is None]
    for proc in live:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for proc in live:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for child in children:
        if child.proc is not None:
            ipc.unlink_stale(child.proc.pid)
