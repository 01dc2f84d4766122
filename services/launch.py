"""The local launcher (`spillway serve`): every service as its own OS process, supervised.

It creates a private run directory for the ipc:// sockets, starts decode, prefill and the router, waits until
the router's /health says every worker is Ready, restarts a worker that dies (the router ends the requests it
held with an error event) or that the router has not heard from for the stall timeout (a hung process: it is
killed first), and on SIGINT/SIGTERM stops everything: children get SIGTERM, then SIGKILL after a grace
period; the run directory and any shared-memory segment a dead child left are removed.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from common import ipc
from common.protocol import ServiceDown
from common.transport import Outbox, ipc_address, make_run_dir

log = logging.getLogger("launch")
GRACE_S = 10.0


@dataclass
class ServeOptions:
    """What `spillway serve` was asked for."""

    model_dir: str
    host: str = "127.0.0.1"
    port: int = 8000
    metrics_port: int = 0
    """Router, prefill, decode, encoder get metrics_port + 0..3 (0: no metrics ports)."""
    served_name: str = ""
    api_key: str | None = None
    max_queue: int = 64
    worker_args: list[str] = field(default_factory=list)
    """Flags passed to both workers: WorkerConfig's, from `services.worker_args.config_argv`."""
    max_running: int = 8
    max_context: int = 4096
    threads: int = 0
    stall_timeout_s: float = 120.0
    """A worker the router has not heard from this long is hung: the router fails its requests, the
    launcher kills it (STALL_KILL_GRACE_S later) and restarts it (0: never)."""


QUICK_EXIT_S = 60.0
"""A child that exits sooner than this after its start failed at start-up (config, checkpoint, memory)."""
MAX_QUICK_EXITS = 4
"""Start-up failures in a row after which the launcher gives up instead of restarting forever."""
STALL_CHECK_S = 1.0
"""How often the launcher reads the router's /health for silent workers."""
STALL_KILL_GRACE_S = 2.0
"""Silence past the stall timeout before the kill: the router's watchdog fails the requests first, with
the reason (hung), rather than the exit's."""


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started: float = 0.0
    quick_exits: int = 0

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv)
        self.started = time.monotonic()
        log.info("started %s (pid %d)", self.name, self.proc.pid)

    def count_exit(self) -> None:
        quick = time.monotonic() - self.started < QUICK_EXIT_S
        self.quick_exits = self.quick_exits + 1 if quick else 0


def _children(opts: ServeOptions, run_dir: Path) -> list[Child]:
    addr = {s: ipc_address(run_dir, s) for s in ("router", "prefill", "decode")}
    metrics = {
        s: (opts.metrics_port + i if opts.metrics_port else 0)
        for i, s in enumerate(("router", "prefill", "decode"))
    }
    common = ["--router", addr["router"], "--threads", str(opts.threads), *opts.worker_args]
    common += ["--stall-timeout", str(opts.stall_timeout_s)]
    py = [sys.executable, "-m"]
    decode = [*py, "services.decode", *common, "--inbox", addr["decode"], "--peer", addr["prefill"]]
    prefill = [*py, "services.prefill", *common, "--inbox", addr["prefill"], "--peer", addr["decode"]]
    router = [
        *py,
        "services.router",
        "--model",
        opts.model_dir,
        "--host",
        opts.host,
        "--port",
        str(opts.port),
    ]
    router += ["--inbox", addr["router"], "--prefill", addr["prefill"], "--decode", addr["decode"]]
    router += ["--max-running", str(opts.max_running), "--max-queue", str(opts.max_queue)]
    router += ["--max-context", str(opts.max_context), "--stall-timeout", str(opts.stall_timeout_s)]
    for svc, port in metrics.items():
        if port:
            (router if svc == "router" else decode if svc == "decode" else prefill).extend(
                ["--metrics-port", str(port)]
            )
    if opts.metrics_port:
        router += ["--worker-metrics", f"prefill=http://127.0.0.1:{metrics['prefill']}/metrics"]
        router += ["--worker-metrics", f"decode=http://127.0.0.1:{metrics['decode']}/metrics"]
    if opts.served_name:
        router += ["--served-model-name", opts.served_name]
    if opts.api_key:
        router += ["--api-key", opts.api_key]
    return [Child("decode", decode), Child("prefill", prefill), Child("router", router)]


def _kill(child: Child, why: str) -> None:
    """SIGKILL a hung child and reap it (`Launcher.supervise` restarts it)."""
    assert child.proc is not None
    log.error("%s (pid %d) %s: killing it", child.name, child.proc.pid, why)
    child.proc.kill()
    child.proc.wait()


class Launcher:
    """Starts, watches and stops the services."""

    def __init__(self, opts: ServeOptions) -> None:
        self.opts = opts
        self.run_dir = make_run_dir()
        self.children = _children(opts, self.run_dir)
        self.router = Outbox(ipc_address(self.run_dir, "router"))
        self.stopping = self.failed = False
        self.router_answered = 0.0
        """time.monotonic() of the router's last /health answer."""

    def health_url(self) -> str:
        return f"http://{self.opts.host}:{self.opts.port}/health"

    def start(self) -> None:
        for child in self.children:
            child.start()

    def wait_ready(self, timeout_s: float = 300.0) -> bool:
        """Watch the services until the router's /health says every worker is Ready."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.stopping:
            if (self.watch() or {}).get("status") == "ok":
                return True
            time.sleep(0.2)
        return False

    def watch(self) -> dict | None:
        """Restart what exited, kill what hangs (`kill_stalled`); the router's /health body, or None."""
        self.supervise()
        health = self.health()
        if self.opts.stall_timeout_s > 0 and not self.stopping:
            self.kill_stalled(health)
        return health

    def health(self) -> dict | None:
        """The router's /health body (200 or 503 alike), or None while it does not answer."""
        try:
            with urllib.request.urlopen(self.health_url(), timeout=2) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:  # 503: some worker is not up; the body says which
            with exc:
                return json.loads(exc.read())
        except (OSError, ValueError):
            return None

    def kill_stalled(self, health: dict | None) -> None:
        """Kill each worker the router (its /health body `health`) has not heard from for the stall timeout
        (hung: no exit to see), and the router if it stopped answering for as long (once it has answered
        since its start: its start-up is not timed); `supervise` then restarts it as a crashed one."""
        now = time.monotonic()
        limit = self.opts.stall_timeout_s + STALL_KILL_GRACE_S
        router = next(c for c in self.children if c.name == "router")
        if health is not None:
            self.router_answered = now
        elif router.proc is not None and router.proc.poll() is None and self.router_answered > router.started:
            if now - self.router_answered > limit:
                _kill(router, f"has not answered for {now - self.router_answered:.0f} s")
            return
        services = (health or {}).get("services", {})
        for child in self.children:
            svc = services.get(child.name)
            if child.proc is None or child.proc.poll() is not None or not svc or svc["pid"] != child.proc.pid:
                continue
            silent = svc.get("last_seen_s")
            if silent is not None and silent > limit:
                _kill(child, f"silent for {silent:.0f} s")

    def supervise(self) -> None:
        """Restart any child that exited (and sweep the shared memory it leaves); give up on one that keeps
        failing at start-up (the launcher then stops, with `failed` set)."""
        for child in self.children:
            if child.proc is None or child.proc.poll() is None or self.stopping:
                continue
            code = child.proc.returncode
            if child.name != "router":
                self.router.send(ServiceDown(child.name, child.proc.pid, code))
            ipc.unlink_stale(child.proc.pid)
            child.count_exit()
            if child.quick_exits >= MAX_QUICK_EXITS:
                log.error("%s failed %d times at start-up (last exit %s): giving up", child.name,
                          child.quick_exits, code)  # fmt: skip
                self.failed = self.stopping = True
                return
            log.error("%s exited with %s; restarting", child.name, code)
            child.restarts += 1
            child.start()

    def run(self) -> int:
        """Serve until SIGINT/SIGTERM."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: setattr(self, "stopping", True))
        self.start()
        try:
            if self.wait_ready():
                log.info("serving on http://%s:%d/v1", self.opts.host, self.opts.port)
            last_check = time.monotonic()
            while not self.stopping:
                self.supervise()
                if time.monotonic() - last_check >= STALL_CHECK_S:
                    self.watch()
                    last_check = time.monotonic()
                time.sleep(0.2)
        finally:
            self.stop()
        return 1 if self.failed else 0

    def stop(self) -> None:
        self.stopping = True
        live = [c.proc for c in self.children if c.proc is not None and c.proc.poll() is None]
        for proc in live:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        for proc in live:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for child in self.children:
            if child.proc is not None:
                ipc.unlink_stale(child.proc.pid)
        self.router.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)
