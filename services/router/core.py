"""The router's core: worker health, admission, and the dispatch of token events to waiting requests.

It is library code with no HTTP in it (the FastAPI app in `app.py` is a thin shell around it), so it can be
driven directly. One asyncio task reads the router's inbox: `Tokens` go to the request they name (in order
of `Tokens.index`, because prefill's first token and decode's later ones travel on different connections),
`Ready` and `Heartbeat` update the health of their service. A watchdog task ends the requests in flight
when a worker falls silent for `stall_timeout_s` (hung, not dead: no exit for the launcher to report).

Admission: at most `max_running` requests are in flight to the workers; up to `max_queue` more wait in a
FIFO here (their clients see nothing until a slot frees); beyond that, 429. Every request that ends before
the workers finished it (client gone, stop string, error, router shutdown) is aborted at every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import zmq.asyncio

from common.metrics import RouterMetrics
from common.openai_api import ApiError
from common.protocol import Abort, Generate, Heartbeat, Message, Ready, SamplingParams, ServiceDown, Tokens
from common.transport import AsyncInbox, AsyncOutbox
from services.router.config import RouterConfig

log = logging.getLogger(__name__)

DEFAULT_MAX_RUNNING = 64
"""The admission limit when `max_running` is 0 and no worker has announced a capacity."""
TERMINAL_ERRORS = ("error", "abort")
ORPHANS_REMEMBERED = 4096
"""Requests aborted for orphaned tokens that the router remembers, so that each is aborted once."""


@dataclass
class ServiceHealth:
    """What the router knows of one worker, from its `Ready` and `Heartbeat` messages."""

    name: str
    pid: int | None = None
    instance: str = ""
    """The process's start id (`Ready.instance`): pids alone repeat across containers and hosts."""
    capacity: int = 0
    metrics_url: str = ""
    last_seen: float | None = None
    """time.monotonic() of its last message; None = never heard (still starting)."""
    running: int = 0
    waiting: int = 0
    restarts: int = 0
    max_context: int = 0
    """The context it announced in `Ready` (0: none of its own)."""
    exited: bool = False
    """The launcher reported the process `pid` dead; cleared by a `Ready` from its successor."""
    stalled: bool = False
    """Silent past the stall timeout (its requests were failed); cleared when it is heard again."""
    linked: bool | None = None
    """Whether the router's connection to its inbox is open (None: not yet). An exit closes it at once: the
    requests in flight fail then, where no launcher reports the exit (one container a service); the
    service is down, then starting, until the process behind the new connection speaks."""

    def state(self, now: float, timeout_s: float) -> str:
        """ "starting" (never heard), "up", or "down" (exited, stalled, its connection closed, or silent for
        longer than `timeout_s`)."""
        if self.exited or self.stalled or self.linked is False:
            return "down"
        if self.last_seen is None:
            return "starting"
        return "up" if now - self.last_seen <= timeout_s else "down"


@dataclass
class Flight:
    """A request the workers are running: its parameters, timing, and its ordered event queue."""

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    received: float
    """time.monotonic() when the HTTP request arrived (TTFT and e2e latency count from here)."""
    events: asyncio.Queue[Tokens] = field(default_factory=asyncio.Queue)
    worker_done: bool = False
    """The workers ended it themselves (stop | length): nothing to abort."""
    next_index: int = 0
    pending: dict[int, list[Tokens]] = field(default_factory=dict)
    """Events that arrived ahead of their turn, by `Tokens.index`."""
    last_token_at: float | None = None
    released: bool = False

    @property
    def arrival(self) -> float:
        """When the HTTP request arrived, in Unix seconds (`received` on the wall clock)."""
        return time.time() - (time.monotonic() - self.received)

    async def next_event(self) -> Tokens:
        """The next event in generation order (an error or abort may overtake tokens)."""
        return await self.events.get()


class RouterCore:
    """Admission, dispatch and health of the router; `start` binds its sockets, `close` releases them."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.services = {name: ServiceHealth(name) for name in config.expected_services}
        self._flights: dict[str, Flight] = {}
        self._running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._dropped_seen = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._inbox: AsyncInbox | None = None
        self._prefill: AsyncOutbox | None = None
        self._decode: AsyncOutbox | None = None
        self._reader: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._links: list[asyncio.Task[None]] = []
        self._orphans: deque[str] = deque(maxlen=ORPHANS_REMEMBERED)
        """Requests aborted for tokens nobody waits for (the latest; as decode's `gone`)."""

    # Lifecycle.

    async def start(self) -> None:
        """Bind the inbox, connect to the workers, start reading (inside the serving event loop)."""
        self._ctx = zmq.asyncio.Context()
        self._inbox = AsyncInbox(self.config.inbox, self._ctx)
        self._prefill = AsyncOutbox(self.config.prefill, self._ctx, monitor=True)
        self._decode = AsyncOutbox(self.config.decode, self._ctx, monitor=True)
        self._reader = asyncio.create_task(self._read_inbox(), name="router-inbox")
        self._links = [
            asyncio.create_task(self._watch_link(name, box), name=f"router-link-{name}")
            for name, box in (("prefill", self._prefill), ("decode", self._decode))
        ]
        if self.config.stall_timeout_s > 0:
            self._watchdog = asyncio.create_task(self._watch_stalls(), name="router-watchdog")

    async def close(self) -> None:
        """Abort everything in flight at the workers, then close the sockets."""
        for task in (self._reader, self._watchdog, *self._links):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for rid in list(self._flights):
            self._spawn(self._send_abort(rid))
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=1.0)
        for sock in (self._inbox, self._prefill, self._decode):
            if sock is not None:
                sock.close()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)

    # Health.

    def ready(self) -> bool:
        """Every expected worker is up (announced itself and heartbeats in time)."""
        now = time.monotonic()
        return all(
            self.services[name].state(now, self.config.heartbeat_timeout_s) == "up"
            for name in self.config.expected_services
        )

    def health(self) -> dict[str, Any]:
        """The `/health` body: each service's state and metrics URL, and the router's own load."""
        now = time.monotonic()
        services = {}
        for name, svc in self.services.items():
            services[name] = {
                "state": svc.state(now, self.config.heartbeat_timeout_s),
                "pid": svc.pid,
                "capacity": svc.capacity,
                "running": svc.running,
                "waiting": svc.waiting,
                "restarts": svc.restarts,
                "last_seen_s": None if svc.last_seen is None else round(now - svc.last_seen, 3),
                "metrics_url": svc.metrics_url or self.config.metrics_urls.get(name, ""),
            }
        return {
            "status": "ok" if self.ready() else "unavailable",
            "services": services,
            "router": {
                "running": self._running,
                "waiting": len(self._waiters),
                "max_running": self.max_running(),
                "max_queue": self.config.max_queue,
            },
        }

    def context_limit(self, configured: int) -> int:
        """The longest prompt + completion to admit: `configured`, or less where a worker announced less."""
        announced = (self.services[name].max_context for name in self.config.expected_services)
        return min([configured, *(c for c in announced if c > 0)])

    def check_stalls(self) -> None:
        """Fail the requests in flight once for each worker silent past the stall timeout (the watchdog's
        tick; public so that tests can step it)."""
        now = time.monotonic()
        for svc in self.services.values():
            silent = None if svc.last_seen is None else now - svc.last_seen
            if svc.exited or svc.stalled or silent is None or silent <= self.config.stall_timeout_s:
                continue
            svc.stalled = True
            log.error("%s (pid %s) has been silent for %.0f s: taken as hung", svc.name, svc.pid, silent)
            self._fail_all(f"the {svc.name} worker stopped responding ({silent:.0f} s without a heartbeat)")

    def on_link(self, service: str, up: bool) -> None:
        """The router's connection to `service`'s inbox opened (`up`) or closed. Closed after being open: the
        worker exited (or its host is gone), so the requests in flight fail now, as on the launcher's
        `ServiceDown`, not after the stall timeout (public so that tests can step it)."""
        svc = self.services.setdefault(service, ServiceHealth(service))
        was, svc.linked = svc.linked, up
        if up or not was or svc.exited:
            return
        svc.last_seen = None  # "starting" once the connection is back, until the process behind it speaks
        log.error("%s (pid %s): its connection closed", service, svc.pid)
        self._fail_all(f"the {service} worker's connection closed (it exited)")

    async def _watch_link(self, service: str, outbox: AsyncOutbox) -> None:
        try:
            while True:
                self.on_link(service, await outbox.link_changed())
        except zmq.ZMQError:  # the context is going (close): nothing left to watch
            log.debug("%s: connection monitor ended", service, exc_info=True)

    async def _watch_stalls(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.config.stall_timeout_s / 4))
            self.check_stalls()

    def max_running(self) -> int:
        """The admission limit: configured, else the smallest announced worker capacity."""
        if self.config.max_running > 0:
            return self.config.max_running
        known = [self.services[name].capacity for name in self.config.expected_services]
        return min((c for c in known if c > 0), default=DEFAULT_MAX_RUNNING)

    # Admission.

    async def submit(
        self, prompt_ids: list[int], sampling: SamplingParams, received: float, rid: str | None = None
    ) -> Flight:
        """Admit a request (waiting for a slot) and send it to prefill; raises ApiError 503 / 429.

        `received` is the request's arrival, time.monotonic(); `rid` its id (default: a new one).
        Cancelling the caller while it waits gives its place up; cancelling it after admission aborts the
        request at the workers.
        """
        self._refuse_unless_ready()
        queued = time.monotonic()
        if self._running < self.max_running() and not self._waiters:
            self._running += 1
        else:
            await self._wait_for_slot()
            if not self.ready():  # a worker went down while this request waited: the slot passes on
                self._free_slot()
                self._update_gauges()
                self._refuse_unless_ready()
        self.metrics.queue_time.observe(time.monotonic() - queued)
        self._update_gauges()
        flight = Flight(rid or uuid.uuid4().hex, prompt_ids, sampling, received)
        self._flights[flight.rid] = flight
        try:
            assert self._prefill is not None, "RouterCore.start() was not called"
            await self._prefill.send(Generate(flight.rid, prompt_ids, sampling, arrival=flight.arrival))
        except BaseException:
            self.release(flight, None)
            raise
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        return flight

    def _refuse_unless_ready(self) -> None:
        if not self.ready():
            raise ApiError(503, "The model workers are not ready.", type="server_error", code="not_ready")

    async def _wait_for_slot(self) -> None:
        if len(self._waiters) >= self.config.max_queue:
            raise ApiError(
                429,
                f"The server is busy: {self._running} requests running and {len(self._waiters)} waiting.",
                type="rate_limit_error",
                code="queue_full",
            )
        slot: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(slot)
        self._update_gauges()
        try:
            await slot
        except asyncio.CancelledError:
            if slot.done() and not slot.cancelled():
                self._free_slot()  # handed to us as we were cancelled: pass it on
            else:
                self._waiters.remove(slot)
            self._update_gauges()
            raise

    def release(self, flight: Flight, finish_reason: str | None) -> None:
        """The request is over for the router: free its slot; abort it at the workers if they may hold it.

        `finish_reason` is what the client was told (None when it ended in an error or disconnect).
        Synchronous, so that it can run in the `finally` of a cancelled task.
        """
        if flight.released:
            return
        flight.released = True
        self._flights.pop(flight.rid, None)
        if not flight.worker_done:
            self._spawn(self._send_abort(flight.rid))
        if finish_reason is not None:
            self.metrics.requests_finished.labels(finish_reason=finish_reason).inc()
            self.metrics.e2e_request_latency.observe(time.monotonic() - flight.received)
        self._free_slot()
        self._update_gauges()

    def _free_slot(self) -> None:
        while self._waiters and self._running <= self.max_running():
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes straight to the first waiter
                return
        self._running -= 1

    def _admit_waiters(self) -> None:
        """Start waiters while the limit allows (it can rise when workers announce their capacity)."""
        while self._waiters and self._running < self.max_running():
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._running += 1
                waiter.set_result(None)
        self._update_gauges()

    def _update_gauges(self) -> None:
        self.metrics.requests_running.set(self._running)
        self.metrics.requests_waiting.set(len(self._waiters))

    def sync_dropped_frames(self) -> None:
        """Carry the inbox's count of undecodable frames into the metrics (called before a scrape)."""
        if self._inbox is not None and self._inbox.dropped > self._dropped_seen:
            self.metrics.dropped_frames.inc(self._inbox.dropped - self._dropped_seen)
            self._dropped_seen = self._inbox.dropped

    # Dispatch.

    async def _read_inbox(self) -> None:
        assert self._inbox is not None
        while True:
            msg = await self._inbox.recv()
            try:
                self.on_message(msg)
            except Exception:  # a bad message must not stop the router
                log.exception("failed to handle %r", msg)

    def on_message(self, msg: Message) -> None:
        """Apply one inbox message (public so that tests and tools can feed the core directly)."""
        if isinstance(msg, Tokens):
            self._on_tokens(msg)
        elif isinstance(msg, Ready | Heartbeat):
            self._on_alive(msg)
        elif isinstance(msg, ServiceDown):
            self._on_down(msg)
        else:
            log.warning("router ignores %s messages", type(msg).__name__)

    def _on_down(self, msg: ServiceDown) -> None:
        svc = self.services.setdefault(msg.service, ServiceHealth(msg.service))
        if svc.pid == msg.pid and not svc.exited:
            svc.exited = True
            log.error("%s (pid %d) exited with %d", msg.service, msg.pid, msg.exit_code)
            self._fail_all(f"the {msg.service} worker exited (code {msg.exit_code})")

    def _on_alive(self, msg: Ready | Heartbeat) -> None:
        svc = self.services.setdefault(msg.service, ServiceHealth(msg.service))
        same = (svc.pid, svc.instance) == (msg.pid, msg.instance)
        if svc.exited and (same or isinstance(msg, Heartbeat)):
            return  # a late message of the dead process, or a successor not Ready yet
        if svc.linked is False and isinstance(msg, Heartbeat):
            return  # sent before its connection closed: it must not make the successor look up
        svc.exited = False
        if svc.stalled:
            svc.stalled = False
            log.warning("%s (pid %d) is heard again after a stall", msg.service, msg.pid)
        if svc.pid is not None and not same:
            svc.restarts += 1
            self._fail_all(f"the {msg.service} worker restarted (pid {svc.pid} → {msg.pid})")
        svc.pid, svc.instance = msg.pid, msg.instance
        svc.last_seen = time.monotonic()
        if isinstance(msg, Ready):
            svc.capacity, svc.max_context = msg.capacity, msg.max_context
            svc.metrics_url = msg.metrics_url or svc.metrics_url
            log.info("%s is ready (pid %d, capacity %d)", msg.service, msg.pid, msg.capacity)
            self._admit_waiters()
        else:
            svc.running, svc.waiting = msg.running, msg.waiting
            if msg.capacity and not svc.capacity:  # a router restarted after the worker's Ready
                svc.capacity, svc.max_context = msg.capacity, msg.max_context
                self._admit_waiters()

    def _fail_all(self, reason: str) -> None:
        """Requests in flight died with a worker: end each with an error event."""
        for flight in self._flights.values():
            flight.events.put_nowait(Tokens(flight.rid, [], "error", error=reason))

    def _on_tokens(self, event: Tokens) -> None:
        flight = self._flights.get(event.rid)
        if flight is None:
            self._abort_orphan(event)
            return
        if event.finish_reason in TERMINAL_ERRORS:
            flight.events.put_nowait(event)
            return
        if event.index < flight.next_index:
            log.warning("dropping a duplicate event of %s at index %d", event.rid, event.index)
            return
        flight.pending.setdefault(event.index, []).append(event)
        while flight.next_index in flight.pending:
            for ready in flight.pending.pop(flight.next_index):
                self._deliver(flight, ready)

    def _deliver(self, flight: Flight, event: Tokens) -> None:
        now = time.monotonic()
        count = len(event.token_ids)
        if count:
            if flight.last_token_at is None:
                self.metrics.time_to_first_token.observe(now - flight.received)
            else:  # an event of several tokens (speculative decoding) spreads its gap over them
                gap = (now - flight.last_token_at) / count
                for _ in range(count):
                    self.metrics.inter_token_latency.observe(gap)
            flight.last_token_at = now
            self.metrics.generation_tokens.inc(count)
        flight.next_index += count
        if event.finish_reason is not None:
            flight.worker_done = True
        flight.events.put_nowait(event)

    # Aborts.

    def _abort_orphan(self, event: Tokens) -> None:
        """Tokens of a request this router does not hold: a late event of one it ended, or one its
        predecessor sent before a router restart, which would hold a lane and its pages to max_tokens for
        nobody. Abort it at the workers, once per request."""
        if event.finish_reason is not None or event.rid in self._orphans:
            return
        self._orphans.append(event.rid)
        self._spawn(self._send_abort(event.rid))

    async def _send_abort(self, rid: str) -> None:
        for outbox in (self._prefill, self._decode):
            if outbox is not None:
                try:
                    await outbox.send(Abort(rid))
                except zmq.ZMQError as exc:
                    log.warning("could not send Abort(%s) to %s: %s", rid, outbox.address, exc)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` as its own task (outside the caller's cancellation), keeping a reference to it."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
