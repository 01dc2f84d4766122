"""Supervision of the workers: each one's health from its `Ready`, `Heartbeat` and `ServiceDown` messages and
its connection, the pairs they form, and the stall watchdog's verdicts.

A worker that exits, restarts, falls silent past `stall_timeout_s` (hung, not dead: no exit for the launcher
to report) or whose connection closes is reported once to the failure handler, with the pair it belongs to
(None for the shared vision encoder) and a reason a client can read; that handler fails the requests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from common.ipc.transport import pair_names
from common.metrics import RouterMetrics
from common.protocol import Heartbeat, Ready, ServiceDown
from common.vision.images import vision_config
from services.router.config import RouterConfig
from services.router.pairs import Pair, ServiceHealth

log = logging.getLogger(__name__)

FailureHandler = Callable[[Pair | None, str, bool], None]
"""Called with the pair whose worker died (None: the encoder), the reason, and whether that worker was the
pair's prefill (the requests its decode worker already holds go on), once a death."""


def watch_period(config: RouterConfig) -> float:
    """Seconds between the watchdog's ticks: a quarter of the shortest timeout, at most 1; 0 = none."""
    timeouts = [t for t in (config.stall_timeout_s, config.event_gap_timeout_s) if t > 0]
    return min(1.0, *(t / 4 for t in timeouts)) if timeouts else 0.0


class Supervisor:
    """The router's view of its workers: `pairs`, `services` by name (the encoder's among them) and their
    states; it applies the workers' messages and connection changes, and reports deaths to `on_failure`."""

    def __init__(
        self, config: RouterConfig, on_failure: FailureHandler, metrics: RouterMetrics | None = None
    ) -> None:
        self.config = config
        self._metrics = metrics
        names = [pair_names(i) for i in range(len(config.pairs))]
        self.pairs = [Pair(i, ServiceHealth(p), ServiceHealth(d)) for i, (p, d) in enumerate(names)]
        self.services = {w.name: w for pair in self.pairs for w in pair.workers}
        self._pair_of = {w.name: pair for pair in self.pairs for w in pair.workers}
        vision = config.encoder and vision_config(config.model_dir) is not None
        self.encoder = ServiceHealth("encoder") if vision else None
        """The vision encoder (a model with a vision tower, `RouterConfig.encoder` given), shared by the pairs
        (a text-only model's encoder, as one docker-compose starts for any model, exits at once)."""
        if self.encoder is not None:
            self.services[self.encoder.name] = self.encoder
        for name, svc in self.services.items():
            svc.restarts = config.restarts.get(name, 0)
        self._unknown: set[str] = set()
        """Service names heard that no pair has (warned about once each)."""
        self._on_failure = on_failure
        self.stopping = False
        """The router is stopping (a signal): workers' exits are expected, logged as information."""
        self._served = False
        """Some pair has been up (the first time is logged: the server answers from then on)."""
        self._pair_states: dict[int, str] = {}
        """Each pair's state as last logged and exported (`track_states`)."""
        self.track_states()

    # States.

    def up_pairs(self) -> list[Pair]:
        """The pairs whose two workers are up (announced themselves and heartbeat in time)."""
        now = time.monotonic()
        return [p for p in self.pairs if p.state(now, self.config.heartbeat_timeout_s) == "up"]

    def ready(self) -> bool:
        """Some pair is up: requests can be served."""
        return bool(self.up_pairs())

    def encoder_up(self) -> bool:
        """The encoder is up (or there is none: nothing waits for it)."""
        enc = self.encoder
        return enc is None or enc.state(time.monotonic(), self.config.heartbeat_timeout_s) == "up"

    def status(self) -> str:
        """ "ok" (every pair up, and the encoder where there is one), "degraded" (some pair up: serving with
        less capacity, or without images) or "unavailable"."""
        up = len(self.up_pairs())
        if not up:
            return "unavailable"
        return "ok" if up == len(self.pairs) and self.encoder_up() else "degraded"

    def track_states(self, now: float | None = None) -> None:
        """Log each pair whose state changed since the last call (with its workers' reasons where it is not
        up) and export every pair's (`RouterMetrics.pair_state`, `pair_changes`); `now`: time.monotonic()."""
        now = time.monotonic() if now is None else now
        timeout = self.config.heartbeat_timeout_s
        for pair in self.pairs:
            state, was = pair.state(now, timeout), self._pair_states.get(pair.index)
            if state == was:
                continue
            self._pair_states[pair.index] = state
            if was is not None or state != "starting":
                down = state == "down" and not self.stopping
                log.log(logging.ERROR if down else logging.INFO, "%s", pair.why(now, timeout))
            if self._metrics is not None:
                label = str(pair.index)
                for name in ("starting", "up", "down"):
                    self._metrics.pair_state.labels(pair=label, state=name).set(float(name == state))
                self._metrics.pair_changes.labels(pair=label, state=state).inc()

    def unready_reason(self) -> str:
        """Why no pair can take a request now: each pair's state and its workers' reasons."""
        now = time.monotonic()
        return "; ".join(p.why(now, self.config.heartbeat_timeout_s) for p in self.pairs)

    def context_limit(self, configured: int) -> int:
        """The longest prompt + completion to admit: `configured`, or less where a worker announced less."""
        announced = (svc.max_context for svc in self.services.values())
        return min([configured, *(c for c in announced if c > 0)])

    def service_report(self) -> dict[str, dict[str, Any]]:
        """`/health`'s services: each one's state, process, load, restarts and metrics URL, by name."""
        now = time.monotonic()
        return {name: self._report(svc, now) for name, svc in self.services.items()}

    def _report(self, svc: ServiceHealth, now: float) -> dict[str, Any]:
        return {
            "state": svc.state(now, self.config.heartbeat_timeout_s),
            "pid": svc.pid,
            "capacity": svc.capacity,
            "running": svc.running,
            "waiting": svc.waiting,
            "restarts": svc.restarts,
            "last_seen_s": None if (idle := svc.idle(now)) is None else round(idle, 3),
            "metrics_url": svc.metrics_url or self.config.metrics_urls.get(svc.name, ""),
        }

    def metrics_targets(self) -> list[dict[str, Any]]:
        """Prometheus HTTP service discovery: a target group for each worker whose metrics URL is known (its
        present process's, from its `Ready`, else the configured one), labelled with its job (its role:
        prefill, decode, encoder), service name, pair and served model name; a restarted worker's address
        replaces the old."""
        groups = []
        for name, svc in self.services.items():
            url = urlsplit(svc.metrics_url or self.config.metrics_urls.get(name, ""))
            if not url.netloc:
                continue
            pair = None if svc is self.encoder else self._pair_of[name]
            role = "encoder" if pair is None else "prefill" if svc is pair.prefill else "decode"
            labels = {"job": role, "service": name, "model": self.config.model_name}
            labels["__metrics_path__"] = url.path or "/metrics"
            labels["__scheme__"] = url.scheme or "http"
            if pair is not None:
                labels["pair"] = str(pair.index)
            groups.append({"targets": [url.netloc], "labels": labels})
        return groups

    def pair_report(self) -> list[dict[str, Any]]:
        """`/health`'s pairs, in order: their workers' names, state, requests running and capacity."""
        now = time.monotonic()
        timeout = self.config.heartbeat_timeout_s
        return [
            {
                "prefill": p.prefill.name,
                "decode": p.decode.name,
                "state": p.state(now, timeout),
                "running": p.running,
                "capacity": p.capacity(),
            }
            for p in self.pairs
        ]

    # Messages and connections.

    def on_alive(self, msg: Ready | Heartbeat) -> bool:
        """Apply a `Ready` or `Heartbeat`: True when it counted (its pair may be up again, so the admission
        limit may have risen), False when it was ignored (an unknown name, a late word of a dead process)."""
        svc = self._service(msg.service)
        if svc is None or self._stale(svc, msg):
            return False
        self._heard(svc, msg)
        self._record(svc, msg)
        self.track_states()
        if not self._served and self.ready():
            self._served = True
            log.info("ready: pair %d is up and requests are served", self.up_pairs()[0].index)
        return True

    def _heard(self, svc: ServiceHealth, msg: Ready | Heartbeat) -> None:
        """`svc`'s process (`msg`'s) is alive: clear its exit and stall; a new process is a restart, which
        fails what the old one held."""
        svc.exited = False
        if svc.stalled:
            svc.stalled = False
            log.warning("%s (pid %d) is heard again after a stall", msg.service, msg.pid)
        if svc.pid is not None and (svc.pid, svc.instance) != (msg.pid, msg.instance):
            svc.restarts += 1
            self._fail(svc, f"the {msg.service} worker restarted (pid {svc.pid} → {msg.pid})")
        svc.pid, svc.instance = msg.pid, msg.instance
        now = time.monotonic()
        if isinstance(msg, Heartbeat) and svc.last_seen is not None:
            self._check_late(svc, now - svc.last_seen)
        svc.last_seen = now
        svc.progressed = now - msg.loop_s if isinstance(msg, Heartbeat) else now

    def _check_late(self, svc: ServiceHealth, gap: float) -> None:
        """A heartbeat `gap` seconds after the worker's previous message: past the heartbeat timeout, the
        worker counted as down meanwhile (503s): logged and counted."""
        if gap > self.config.heartbeat_timeout_s:
            log.warning("%s (pid %s): a heartbeat %.1f s after its previous message (timeout %.1f s)",
                        svc.name, svc.pid, gap, self.config.heartbeat_timeout_s)  # fmt: skip
            if self._metrics is not None:
                self._metrics.late_heartbeats.labels(service=svc.name).inc()

    @staticmethod
    def _record(svc: ServiceHealth, msg: Ready | Heartbeat) -> None:
        """Take what `msg` announces: capacity, context and metrics URL (`Ready`), load (`Heartbeat`)."""
        svc.image_tokens = msg.image_tokens or svc.image_tokens
        if isinstance(msg, Ready):
            svc.capacity, svc.max_context = msg.capacity, msg.max_context
            svc.metrics_url = msg.metrics_url or svc.metrics_url
            log.info("%s is ready (pid %d, capacity %d)", msg.service, msg.pid, msg.capacity)
        else:
            svc.running, svc.waiting = msg.running, msg.waiting
            if msg.capacity and not svc.capacity:  # a router restarted after the worker's Ready
                svc.capacity, svc.max_context = msg.capacity, msg.max_context

    @staticmethod
    def _stale(svc: ServiceHealth, msg: Ready | Heartbeat) -> bool:
        """`msg` must not make `svc` look alive: a late message of the dead process, a heartbeat of a
        successor not Ready yet, or one sent before its connection closed."""
        same = (svc.pid, svc.instance) == (msg.pid, msg.instance)
        if svc.exited and (same or isinstance(msg, Heartbeat)):
            return True
        return svc.linked is False and isinstance(msg, Heartbeat)

    def on_down(self, msg: ServiceDown) -> None:
        """The launcher saw the process exit: fail what it held (once, and only for the process named)."""
        svc = self._service(msg.service)
        if svc is not None and svc.pid == msg.pid and not svc.exited:
            svc.exited, svc.lost = True, f"exited with code {msg.exit_code}"
            level = logging.INFO if self.stopping else logging.ERROR
            log.log(level, "%s (pid %d) exited with %d", msg.service, msg.pid, msg.exit_code)
            self._fail(svc, f"the {msg.service} worker exited (code {msg.exit_code})")
            self.track_states()

    def on_moved(self, pair: Pair) -> None:
        """`pair`'s workers were started again elsewhere (`PairMoved`): what it held fails (once: not again
        for the old connections' ends), and its workers count as starting until the new processes speak."""
        for svc in pair.workers:
            if not (svc.exited or svc.stalled or svc.linked is False):
                svc.lost = "its host was replaced"
                self._fail(svc, f"the {svc.name} worker's host was replaced")
            svc.pid, svc.instance, svc.last_seen, svc.progressed = None, "", None, None
            svc.exited = svc.stalled = False
            svc.linked, svc.metrics_url, svc.capacity = None, "", 0
        log.info("pair %d moved: its workers start again at new addresses", pair.index)
        self.track_states()

    def on_link(self, service: str, up: bool) -> None:
        """The router's connection to `service`'s inbox opened (`up`) or closed. Closed after being open: the
        worker exited (or its host is gone), so what it held fails now, as on the launcher's `ServiceDown`,
        not after the stall timeout; the service counts as starting until its process speaks."""
        svc = self.services[service]
        was, svc.linked = svc.linked, up
        if up or not was or svc.exited:
            return
        svc.last_seen, svc.lost = None, "its connection closed"
        level = logging.INFO if self.stopping else logging.ERROR
        log.log(level, "%s (pid %s): its connection closed", service, svc.pid)
        self._fail(svc, f"the {service} worker's connection closed (it exited)")
        self.track_states()

    def check_stalls(self, now: float) -> None:
        """Take each worker silent past the stall timeout at `now` (time.monotonic()) as hung and fail what
        it held, once a stall (no-op when the timeout is 0); then log and export the pairs' states."""
        self.track_states(now)
        if self.config.stall_timeout_s <= 0:
            return
        for svc in self.services.values():
            silent = svc.idle(now)
            if svc.exited or svc.stalled or silent is None or silent <= self.config.stall_timeout_s:
                continue
            svc.stalled, svc.lost = True, f"silent for {silent:.0f} s (hung)"
            log.error("%s (pid %s) has been silent for %.0f s: taken as hung", svc.name, svc.pid, silent)
            self._fail(svc, f"the {svc.name} worker stopped responding ({silent:.0f} s without progress)")
            self.track_states(now)

    def _service(self, name: str) -> ServiceHealth | None:
        """The worker `name` names, or None (warned about once) for a name no pair has: a worker started
        with another router's pairs must not fail this router's requests."""
        svc = self.services.get(name)
        if svc is None and name not in self._unknown:
            self._unknown.add(name)
            log.warning("ignoring messages of %r: no pair of this router has a worker of that name", name)
        return svc

    def _fail(self, svc: ServiceHealth, reason: str) -> None:
        pair = None if svc is self.encoder else self._pair_of[svc.name]
        self._on_failure(pair, reason, pair is not None and svc is pair.prefill)
