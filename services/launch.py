"""The local launcher (`spillway serve`): every service as its own OS process, supervised.

It creates a private run directory for the ipc:// sockets, starts the vision encoder (a model with a vision
tower; on the CPU unless `--encoder-device` says otherwise), each prefill/decode pair (`--pairs N`: a GPU
each, or N on the CPU) and the router over them, waits until the router's /health says every worker is
Ready, restarts a worker that dies (the router ends the requests its pair held with an error event) or that
the router has not heard from for the stall timeout (a hung process: it is killed first), and on
SIGINT/SIGTERM stops everything: children get SIGTERM, then SIGKILL after a grace period; the run directory
and any shared-memory segment a dead child left are removed. A launcher SIGKILLed leaves its children to
remove the run directory as they stop with it (`services.parent_watch`); one left even so (the machine went
down) is removed by the next launcher to start (`sweep_run_dirs`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from common.api_key import API_KEY_ENV
from common.config import GRAMMAR_MAX_BYTES
from common.ipc.tensors import process_alive
from common.ipc.transport import Outbox, ipc_address, make_run_dir, pair_names
from common.vision.images import vision_config
from services.children import Child, hand_keys, module_argv, restart_exited, stop_children, worker_argv
from services.logs import LOG_FORMAT_ENV, LOG_LEVEL_ENV
from services.parent_watch import OWNER, RUN_DIR_ENV

log = logging.getLogger("launch")


@dataclass
class ServeOptions:
    """What `spillway serve` was asked for."""

    model_dir: str
    host: str = "127.0.0.1"
    port: int = 8000
    metrics_port: int = 0
    """The router gets metrics_port, pair i's prefill and decode metrics_port + 1 + 2i and + 2 + 2i, the
    encoder the port after the last pair's (0: no metrics ports)."""
    served_name: str = ""
    api_key: str | None = None
    """The key `/v1`, `/metrics` and the metrics ports require (None: none); the services get it in their
    environment (`child_env`), never on a command line."""
    max_image_pixels: int | None = None
    """The router's per-image pixel budget (None: its default)."""
    max_request_pixels: int | None = None
    """The router's per-request pixel budget (None: its default)."""
    max_queue: int = 64
    worker_args: list[str] = field(default_factory=list)
    """Flags passed to both workers: WorkerConfig's, from `services.worker_args.config_argv`."""
    max_context: int = 4096
    threads: int = 0
    stall_timeout_s: float = 120.0
    """A worker whose loop the router has not known to come round this long is hung: the router fails its
    requests, the launcher kills it (STALL_KILL_GRACE_S later) and restarts it (0: never)."""
    heartbeat_timeout_s: float = 5.0
    """A worker whose heartbeats (a thread of their own, every second) stop this long counts as down: the
    router answers 503 while no pair is up."""
    pair_gpus: list[str | None] = field(default_factory=lambda: [None])
    """One entry a prefill/decode pair: the CUDA_VISIBLE_DEVICES of its two workers (None: the launcher's)."""
    encoder_device: str | None = None
    """Where the vision encoder runs (cpu, cuda:N: numbered as the launcher sees the GPUs); None: no encoder
    (a text-only model, or --no-encoder)."""
    encoder_dtype: str = "float32"
    grammar_max_bytes: int = GRAMMAR_MAX_BYTES
    """The largest structured output's form the router lets through (the workers' --grammar-max-bytes)."""
    port_range: tuple[int, int] | None = None
    """Under Ray: the ports (first, last) picked on every node for the inboxes and metrics (a firewall's
    opening); None: any free one."""

    def worker_metrics_port(self, pair: int, role: str) -> int:
        """Pair `pair`'s prefill or decode worker's metrics port (`metrics_port` set)."""
        return self.metrics_port + (1 if role == "prefill" else 2) + 2 * pair

    def encoder_metrics_port(self) -> int:
        """The encoder's metrics port (`metrics_port` set): the one after the last pair's."""
        return self.metrics_port + 1 + 2 * len(self.pair_gpus)

    def ports(self) -> dict[str, int]:
        """Every TCP port the services bind here, by what sets it: the API's, and the metrics' (if any)."""
        ports = {"--port": self.port}
        if self.metrics_port:
            ports["--metrics-port (router)"] = self.metrics_port
            for i, names in enumerate(map(pair_names, range(len(self.pair_gpus)))):
                for role, name in zip(("prefill", "decode"), names, strict=True):
                    ports[f"--metrics-port ({name})"] = self.worker_metrics_port(i, role)
            if self.encoder_device is not None:
                ports["--metrics-port (encoder)"] = self.encoder_metrics_port()
        return ports


STALL_CHECK_S = 1.0
"""How often the launcher reads the router's /health for silent workers."""
STALL_KILL_GRACE_S = 2.0
"""Silence past the stall timeout before the kill: the router's watchdog fails the requests first, with
the reason (hung), rather than the exit's."""


def pair_gpus(pairs: int, device: str) -> list[str | None]:
    """The CUDA_VISIBLE_DEVICES of each of `pairs` pairs whose workers run on `device`: one GPU a pair
    (the decode worker owns its GPU's memory), taken in order from those this process sees; None each on
    the CPU. ValueError where the GPUs are fewer than the pairs, or one is named for all."""
    if pairs < 1:
        raise ValueError(f"--pairs must be at least 1, got {pairs}")
    if pairs == 1 or not device.startswith("cuda"):
        return [None] * pairs
    if device != "cuda":
        raise ValueError(f"--pairs {pairs} gives each pair a GPU of its own: use --device cuda, not {device}")
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus: list[str | None] = (
        [g for g in visible.split(",") if g]
        if visible
        else [str(i) for i in range(torch.cuda.device_count())]
    )
    if len(gpus) < pairs:
        raise ValueError(f"--pairs {pairs} needs a GPU a pair; this machine shows {len(gpus)}")
    return gpus[:pairs]


def has_vision(model_dir: str | Path) -> bool:
    """Whether the model reads images (its config.json has a vision_config): serve then starts an encoder."""
    return vision_config(model_dir) is not None


def router_argv(
    opts: ServeOptions,
    inbox: str,
    pairs: list[tuple[str, str]],
    metrics: dict[str, str],
    encoder: str | None = None,
) -> list[str]:
    """The router's command: its inbox, each pair's (prefill, decode) inboxes, the encoder's inbox (where one
    runs), the workers' metrics URLs by service name; the rest from `opts` (its admission limit: what the
    pairs announce)."""
    argv = [*module_argv("router"), "--model", opts.model_dir, "--host", opts.host, "--port", str(opts.port)]
    argv += ["--inbox", inbox, "--max-running", "0", "--max-queue", str(opts.max_queue)]
    argv += ["--max-context", str(opts.max_context), "--stall-timeout", str(opts.stall_timeout_s)]
    argv += ["--heartbeat-timeout", str(opts.heartbeat_timeout_s)]
    argv += ["--grammar-max-bytes", str(opts.grammar_max_bytes), "--exit-with-parent"]
    for prefill, decode in pairs:
        argv += ["--prefill", prefill, "--decode", decode]
    if encoder is not None:
        argv += ["--encoder", encoder]
    for name, url in metrics.items():
        argv += ["--worker-metrics", f"{name}={url}"]
    if opts.metrics_port:
        argv += ["--metrics-port", str(opts.metrics_port)]
    if opts.served_name:
        argv += ["--served-model-name", opts.served_name]
    if opts.max_image_pixels is not None:
        argv += ["--max-image-pixels", str(opts.max_image_pixels)]
    if opts.max_request_pixels is not None:
        argv += ["--max-request-pixels", str(opts.max_request_pixels)]
    return argv


def child_env(opts: ServeOptions) -> dict[str, str]:
    """What every service gets in its environment beside the launcher's: the API key, where one is set (a
    command line is for anyone's `ps` to read), and the log choice (services/logs.py; a Ray actor's
    services do not inherit the launcher's environment)."""
    env = {k: os.environ[k] for k in (LOG_LEVEL_ENV, LOG_FORMAT_ENV) if k in os.environ}
    return {**env, API_KEY_ENV: opts.api_key} if opts.api_key else env


def worker_flags(opts: ServeOptions) -> list[str]:
    """The flags both workers of every pair take (they stop with their launcher, even a SIGKILLed one)."""
    flags = [*opts.worker_args, "--threads", str(opts.threads), "--stall-timeout", str(opts.stall_timeout_s)]
    return [*flags, "--exit-with-parent"]


def encoder_argv(opts: ServeOptions, inbox: str, router: str, prefills: dict[str, str]) -> list[str]:
    """The encoder's command: its inbox, the router's, each pair's prefill inbox by service name (where its
    results go); device and dtype from `opts` (it stops with its launcher, as the workers do)."""
    assert opts.encoder_device is not None, "no encoder is asked for"
    argv = [*module_argv("encoder"), "--model", opts.model_dir, "--name", "encoder"]
    argv += ["--inbox", inbox, "--router", router]
    for name, address in prefills.items():
        argv += ["--prefill", f"{name}={address}"]
    argv += ["--device", opts.encoder_device, "--dtype", opts.encoder_dtype, "--threads", str(opts.threads)]
    return [*argv, "--stall-timeout", str(opts.stall_timeout_s), "--exit-with-parent"]


def service_children(opts: ServeOptions, run_dir: Path) -> list[Child]:
    """The encoder (where `opts` asks for one), each pair's decode and prefill, then the router over them."""
    router_inbox = ipc_address(run_dir, "router")
    encoder = ipc_address(run_dir, "encoder") if opts.encoder_device is not None else None
    pairs, metrics, children, prefills = [], {}, [], {}
    for i, gpu in enumerate(opts.pair_gpus):
        prefill_name, decode_name = pair_names(i)
        inbox = {"prefill": ipc_address(run_dir, prefill_name), "decode": ipc_address(run_dir, decode_name)}
        pairs.append((inbox["prefill"], inbox["decode"]))
        prefills[prefill_name] = inbox["prefill"]
        # decode first: it owns the memory prefill maps (either order works: prefill asks for it)
        for role, name, peer in (("decode", decode_name, "prefill"), ("prefill", prefill_name, "decode")):
            argv = worker_argv(role, name, inbox[role], inbox[peer], router_inbox, worker_flags(opts))
            if role == "prefill" and encoder is not None:
                argv += ["--encoder", encoder]
            if opts.metrics_port:
                port = opts.worker_metrics_port(i, role)
                argv += ["--metrics-port", str(port)]
                metrics[name] = f"http://127.0.0.1:{port}/metrics"
            children.append(Child(name, argv, gpu, child_env(opts)))
    if encoder is not None:
        children.insert(0, _encoder_child(opts, encoder, router_inbox, prefills, metrics))
    router = Child("router", router_argv(opts, router_inbox, pairs, metrics, encoder), env=child_env(opts))
    return [*children, router]


def _encoder_child(
    opts: ServeOptions, inbox: str, router: str, prefills: dict[str, str], metrics: dict[str, str]
) -> Child:
    """The encoder (on the launcher's GPUs: --encoder-device names one of them); its metrics port is the one
    after the last pair's, its URL added to `metrics`."""
    argv = encoder_argv(opts, inbox, router, prefills)
    if opts.metrics_port:
        port = opts.encoder_metrics_port()
        argv += ["--metrics-port", str(port)]
        metrics["encoder"] = f"http://127.0.0.1:{port}/metrics"
    return Child("encoder", argv, env=child_env(opts))


def sweep_run_dirs(root: Path | None = None) -> list[Path]:
    """Remove the run directories (under `root`, the temporary directory by default) of this user's
    launchers that are gone (a SIGKILLed launcher cannot remove its own; its workers end with it); returns
    them. A directory that names no launcher (a test's, another tool's) is left alone."""
    swept = []
    for run_dir in Path(root or tempfile.gettempdir()).glob("spillway-*"):
        try:
            if run_dir.stat().st_uid != os.getuid():
                continue
            pid = int((run_dir / OWNER).read_text())
        except (OSError, ValueError):
            continue
        if not process_alive(pid):
            shutil.rmtree(run_dir, ignore_errors=True)
            swept.append(run_dir)
    return swept


class Launcher:
    """Starts, watches and stops the services."""

    def __init__(self, opts: ServeOptions) -> None:
        self.opts = opts
        sweep_run_dirs()
        self.run_dir = make_run_dir()
        (self.run_dir / OWNER).write_text(str(os.getpid()))
        self.children = service_children(opts, self.run_dir)
        for child in self.children:  # (they remove it should this launcher be SIGKILLed)
            child.env = {**child.env, RUN_DIR_ENV: str(self.run_dir)}
        keys = hand_keys(self.children)
        self.router = Outbox(ipc_address(self.run_dir, "router"), keys=keys, peer="router")
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
        self.mark_up(health)
        if self.opts.stall_timeout_s > 0 and not self.stopping:
            self.kill_stalled(health)
        return health

    def health(self) -> dict | None:
        """The router's /health body (200 or 503 alike), or None while it does not answer."""
        headers = {"Authorization": f"Bearer {self.opts.api_key}"} if self.opts.api_key else {}
        try:
            request = urllib.request.Request(self.health_url(), headers=headers)
            with urllib.request.urlopen(request, timeout=2) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:  # 503: some worker is not up; the body says which
            with exc:
                return json.loads(exc.read())
        except (OSError, ValueError):
            return None

    def mark_up(self, health: dict | None) -> None:
        """Note each child that came up (the router: it answers; a worker: /health has it up under its pid),
        so that its later exits are not counted as start-up failures (`Child.count_exit`)."""
        if health is None:
            return
        services = health.get("services", {})
        for child in self.children:
            if child.proc is None or child.proc.poll() is not None:
                continue
            svc = services.get(child.name) or {}
            up = child.name == "router" or (svc.get("pid") == child.proc.pid and svc.get("state") == "up")
            child.came_up = child.came_up or up

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
                router.kill(f"has not answered for {now - self.router_answered:.0f} s")
            return
        services = (health or {}).get("services", {})
        for child in self.children:
            svc = services.get(child.name)
            if child.proc is None or child.proc.poll() is not None or not svc or svc["pid"] != child.proc.pid:
                continue
            silent = svc.get("last_seen_s")
            if silent is not None and silent > limit:
                child.kill(f"silent for {silent:.0f} s")

    def supervise(self) -> None:
        """Restart any child that exited (and sweep the shared memory it leaves); give up on one that keeps
        failing at start-up (the launcher then stops, with `failed` set)."""
        if not self.stopping and restart_exited(self.children, self.router) is not None:
            self.failed = self.stopping = True

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
        stop_children(self.children)
        self.router.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)
