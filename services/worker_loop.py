"""The shell every worker shares (prefill, decode, the encoder): sockets, a stop flag set by SIGTERM/SIGINT,
heartbeats (from a thread of their own, so that no long step delays them)."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from common import metrics
from common.api_key import resolve_api_key
from common.ipc.keys import ControlKeys
from common.ipc.transport import Inbox, Outbox
from common.protocol import Abort, Heartbeat, Message, Ready, Tokens
from services.logs import setup_logging
from services.parent_watch import stop_with_parent

if TYPE_CHECKING:
    from common.workers.cache_metrics import CacheMetricsExporter

log = logging.getLogger("worker")
HEARTBEAT_S = 1.0
LOST_EVENTS = "events of this request were lost: the router did not read them in time"
"""The error of a request some of whose events the router's full queue dropped (`WorkerShell.send`)."""
LOST_REMEMBERED = 4096
"""Requests whose dropped events a worker remembers (so that each is failed once)."""
GRAMMAR_POLL_MS = 5
"""While a request waits for its grammar's compile and nothing else steps: how long a worker's loop waits
for a message before it looks again (the compile's end is no message)."""
HANG_EXIT_GRACE_S = 4.0
"""A hung worker ends itself this long after the stall timeout: after the router has failed its requests
(at the timeout, with the reason) and after a launcher's kill (2 s past it), so it matters only where no
launcher runs."""


def reachable(host: str) -> str:
    """The name others reach a server bound to `host` by: the machine's (a container's: its service's) for
    a wildcard address."""
    return socket.gethostname() if host in ("0.0.0.0", "::", "") else host


class WorkerShell:
    """A worker's inbox, its outboxes by destination service, and its lifecycle."""

    def __init__(
        self,
        service: str,
        inbox: str,
        outboxes: dict[str, str],
        threads: int = 0,
        metrics_port: int = 0,
        metrics_host: str = "127.0.0.1",
        stall_timeout_s: float = 0.0,
        exit_with_parent: bool = False,
        keys: ControlKeys | None = None,
        peers: dict[str, str] | None = None,
    ) -> None:
        setup_logging(service)
        if threads:
            torch.set_num_threads(threads)
        self.service, self.pid, self.instance = service, os.getpid(), secrets.token_hex(8)
        self.keys = keys
        """This worker's control-plane keys (None: no CurveZMQ); `peers` names the service behind each of
        `outboxes` where its key is not the service's name (`decode` for pair 1's `decode-1`)."""
        self.inbox = Inbox(inbox, keys=keys)
        self.out = {
            dest: Outbox(address, keys=keys, peer=(peers or {}).get(dest, dest))
            for dest, address in outboxes.items()
        }
        self.stopping = False
        self._last_beat = 0.0
        self.limits = (0, 0, 0)
        """(capacity, max_context, image_tokens) as `ready` announced them, repeated in every heartbeat."""
        self._dropped_seen = 0
        self.router_dropped = 0
        """Messages to the router dropped because it did not read (`send`)."""
        self._failed: dict[str, None] = {}
        """Requests failed for a dropped event, oldest first (LOST_REMEMBERED at most): each failed once."""
        self._undelivered: deque[Tokens] = deque()
        """Their error events, in order, until the router takes them (`receive`)."""
        self._to_abort: list[str] = []
        """Those requests, still to be aborted here (`receive` hands the loop an Abort for each)."""
        self.expert_metrics: CacheMetricsExporter | None = None
        self.registry = metrics.new_registry()
        self.metrics = metrics.WorkerMetrics.create(self.registry)
        self._refusals = metrics.RefusalCount(self.metrics.control_refused)
        self._stop_metrics = (
            metrics.serve(self.registry, metrics_port, metrics_host, resolve_api_key())
            if metrics_port
            else None
        )
        self.metrics_url = f"http://{reachable(metrics_host)}:{metrics_port}/metrics" if metrics_port else ""
        self.stall_timeout_s = stall_timeout_s
        """Once Ready: a loop that has not come round for this long (no heartbeat) is hung: the process dumps
        every thread's stack and exits HANG_EXIT_GRACE_S later, to be restarted (0: never). Start-up is not
        timed, nor is what runs `untimed`. A send blocked as long on the peer worker (its queue full: it
        does not read) counts as hung too; sends to the router never block (`send`)."""
        self._armed = False
        self._load = (0, 0)
        """(running, waiting) as the loop last reported them (`heartbeat`), repeated by the beats."""
        self._progress = time.monotonic()
        """time.monotonic() when the loop last came round (`heartbeat`)."""
        self._untimed = 0
        """Untimed work under way (`untimed`, `working`): the loop counts as coming round meanwhile."""
        self._beats: threading.Thread | None = None
        self._beats_done = threading.Event()
        if exit_with_parent:
            stop_with_parent(self._stop)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)

    @classmethod
    def from_args(
        cls, args, role: str, peer_role: str | None = None, outboxes: dict[str, str] | None = None
    ) -> WorkerShell:
        """The shell a worker's parsed flags (`services.worker_args.add_worker_args`, or the encoder's alike)
        describe: named `--name` or its role, its inbox, outboxes to the router, to its peer (`peer_role`:
        `--peer`) and to the services of `outboxes` (name → address: the encoder's prefill workers)."""
        name = args.name or role
        outboxes = {
            "router": args.router,
            **({peer_role: args.peer} if peer_role else {}),
            **(outboxes or {}),
        }
        peers = {peer_role: peer_role + name.removeprefix(role)} if peer_role else {}
        return cls(
            name,
            args.inbox,
            outboxes,
            args.threads,
            args.metrics_port,
            args.metrics_host,
            args.stall_timeout,
            exit_with_parent=args.exit_with_parent,
            keys=ControlKeys.from_env(),
            peers=peers,
        )

    def _stop(self, *_: object) -> None:
        self.stopping = True

    def reconnect(self, dest: str, address: str) -> None:
        """Send to `dest` at `address` from now on (its process was started again elsewhere)."""
        old = self.out[dest]
        self.out[dest] = Outbox(address, keys=self.keys, peer=old.peer)
        old.close()

    def send(self, dest: str, msg: Message) -> None:
        """To the peer worker: waits while its queue is full. To the router: never waits. Messages for a
        router that does not read (hung, paused, restarting) are dropped once its queue is full: the loop
        must go on for the other peer and its heartbeats. A request that lost an event this way could
        never finish at the router (it orders events by index): it is aborted here, and an error event for
        it is sent once the router reads again (`receive`)."""
        if dest != "router":
            self.out[dest].send(msg)
        elif not self.out[dest].try_send(msg):
            self.router_dropped += 1
            if self.router_dropped in (1, 10, 100) or self.router_dropped % 1000 == 0:
                log.warning("the router does not read: %d messages to it dropped", self.router_dropped)
            if isinstance(msg, Tokens) and msg.rid not in self._failed:
                self._failed[msg.rid] = None
                if len(self._failed) > LOST_REMEMBERED:
                    del self._failed[next(iter(self._failed))]
                self._undelivered.append(Tokens(msg.rid, [], finish_reason="error", error=LOST_EVENTS))
                self._to_abort.append(msg.rid)

    def receive(self, busy: bool, wait_ms: int = 100) -> list[Message]:
        """Everything queued; when idle, wait up to `wait_ms` for the first message. First, an Abort for
        each request that lost events since (`send`), and their error events for the router where it reads
        again."""
        while self._undelivered and self.out["router"].try_send(self._undelivered[0]):
            log.error("%s: %s", self._undelivered.popleft().rid, LOST_EVENTS)
        aborts: list[Message] = [Abort(rid) for rid in self._to_abort]
        self._to_abort.clear()
        msgs = self.inbox.drain()
        if msgs or busy or aborts:
            return [*aborts, *msgs]
        first = self.inbox.recv(timeout_ms=wait_ms)
        return [first, *self.inbox.drain()] if first is not None else []

    def watch_experts(self, provider: object) -> None:
        """Export the expert cache's / arena's counters (when the model's experts are offloaded)."""
        from common.experts.offload import OffloadedExperts
        from common.workers.cache_metrics import CacheMetricsExporter

        if isinstance(provider, OffloadedExperts):  # (again after a peer restart: same metrics, new provider)
            old = self.expert_metrics
            group = old.metrics if old is not None else metrics.ExpertCacheMetrics.create(self.registry)
            self.expert_metrics = CacheMetricsExporter(provider, group)

    def ready(self, capacity: int, max_context: int, image_tokens: int = 0) -> None:
        """Announce the worker (`Ready`), arm the hang watchdog and start the heartbeats' thread."""
        self.limits = (capacity, max_context, image_tokens)
        ready = Ready(
            self.service, self.pid, capacity, self.metrics_url, max_context, self.instance, image_tokens
        )
        self.send("router", ready)
        self._armed = True
        self._progress = time.monotonic()
        self._rearm()
        if self._beats is None:
            self._beats = threading.Thread(target=self._beat_forever, name=f"{self.service}-heartbeats",
                                           daemon=True)  # fmt: skip
            self._beats.start()

    def heartbeat_due(self) -> bool:
        """True once a second: time for the loop to report its load (`heartbeat`) and refresh the gauges."""
        now = time.monotonic()
        if now - self._last_beat < HEARTBEAT_S:
            return False
        self._last_beat = now
        self.metrics.dropped_frames.inc(self.inbox.dropped - self._dropped_seen)
        self._dropped_seen = self.inbox.dropped
        self._refusals.sync(self.inbox.refused, self.inbox.rejected)
        return True

    def heartbeat(self, running: int = 0, waiting: int = 0) -> None:
        """The loop came round with this load: the beats carry it, the hang watchdog is pushed out."""
        if self.expert_metrics is not None:
            self.expert_metrics.update()
        self.metrics.requests_running.set(running)
        self.metrics.requests_waiting.set(waiting)
        self._load, self._progress = (running, waiting), time.monotonic()
        self._rearm()

    def _beat_forever(self) -> None:
        """The heartbeats' thread: a `Heartbeat` every HEARTBEAT_S on a socket of its own (ZeroMQ sockets are
        not shared between threads), whatever the loop does: a long step holds it up no longer (torch
        releases the GIL in its ops; Python switches threads every few ms). Each beat says how long ago the
        loop last came round (`Heartbeat.loop_s`): the router takes a loop silent past its stall timeout
        as hung."""
        box = Outbox(self.out["router"].address, keys=self.keys, peer="router")
        try:
            while not self._beats_done.wait(HEARTBEAT_S):
                box.try_send(self._beat())
        finally:
            box.close()

    def _beat(self) -> Heartbeat:
        capacity, max_context, image_tokens = self.limits
        running, waiting = self._load
        loop_s = 0.0 if self._untimed else time.monotonic() - self._progress
        return Heartbeat(self.service, self.pid, running, waiting, capacity, max_context, self.instance,
                         image_tokens, loop_s)  # fmt: skip

    @contextlib.contextmanager
    def working(self, running: int, waiting: int) -> Iterator[None]:
        """One long piece of work that is no hang (the encoder's tower pass over a large image: minutes on a
        CPU), with this load: untimed, and the beats go on saying the loop comes round."""
        self._load = (running, waiting)
        with self.untimed():
            yield

    def _rearm(self) -> None:
        """Push the hang deadline out. faulthandler's timer is a C thread: it fires even where the loop holds
        the GIL, and no launcher is needed to end the process (one container a service: its restart policy
        starts it again)."""
        if self.stall_timeout_s > 0 and self._armed:
            faulthandler.dump_traceback_later(self.stall_timeout_s + HANG_EXIT_GRACE_S, exit=True)

    @contextlib.contextmanager
    def untimed(self) -> Iterator[None]:
        """Work that may outlast the stall timeout and is no hang (mapping a restarted peer's memory)."""
        faulthandler.cancel_dump_traceback_later()
        armed, self._armed = self._armed, False
        self._untimed += 1
        try:
            yield
        finally:
            self._untimed -= 1
            self._progress = time.monotonic()
            self._armed = armed
            self._rearm()

    def close(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        self._beats_done.set()
        if self._beats is not None:
            self._beats.join()
        if self._stop_metrics is not None:
            self._stop_metrics()
        self.inbox.close()
        for box in self.out.values():
            box.close()
