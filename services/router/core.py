"""The router's core: worker health, admission, and the dispatch of token events to waiting requests.

It is library code with no HTTP in it (the FastAPI app in `app.py` is a thin shell around it), so it can be
driven directly. One asyncio task reads the router's inbox: `Tokens` go to the request they name (in order
of `Tokens.index`, because prefill's first token and decode's later ones travel on different connections),
`Ready` and `Heartbeat` update the health of their service. A watchdog task ends the requests in flight
when a worker falls silent for `stall_timeout_s` (hung, not dead: no exit for the launcher to report), and a
request whose events have a gap that outlives `event_gap_timeout_s` (an event lost on the way).

The workers come in prefill/decode pairs (`RouterConfig.pairs`, one a GPU or a machine). Each admitted
request goes to the up pair with the smallest share of its capacity in use; a worker's exit, stall, restart
or closed connection fails the requests of its pair only. The router serves while any pair is up.

Admission: at most `max_running` requests are in flight to the workers; up to `max_queue` more wait in a
FIFO here (their clients see nothing until a slot frees); beyond that, 429. Every request that ends before
the workers finished it (client gone, stop string, error, router shutdown) is aborted at its pair's workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq.asyncio

from common.ipc.transport import AsyncInbox, AsyncOutbox, pair_names
from common.metrics import RouterMetrics
from common.openai.api import ApiError, bad_request
from common.protocol import (
    Abort,
    Encode,
    Generate,
    Heartbeat,
    Message,
    Ready,
    SamplingParams,
    ServiceDown,
    Sibling,
    Tokens,
)
from common.vision.images import vision_config
from services.router.config import RouterConfig
from services.router.pairs import Pair, ServiceHealth

log = logging.getLogger(__name__)

DEFAULT_MAX_RUNNING = 64
"""The admission limit when `max_running` is 0 and no worker has announced a capacity."""
TERMINAL_ERRORS = ("error", "abort")
ORPHANS_REMEMBERED = 4096
"""Requests aborted for orphaned tokens that the router remembers, so that each is aborted once."""


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
    gap_since: float | None = None
    """time.monotonic() since when `pending` has held events (None while it is empty)."""
    lost: bool = False
    """Its gap outlived `event_gap_timeout_s`: it was failed, and its later events are dropped."""
    last_token_at: float | None = None
    released: bool = False
    pair: int = -1
    """The index of the pair running it (`RouterConfig.pairs`)."""
    images: int = 0
    """Images in its prompt (the encoder holds them until prefill has their embeddings)."""

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
        self.pairs = [
            Pair(i, *(ServiceHealth(name) for name in pair_names(i))) for i in range(len(config.pairs))
        ]
        self.services = {w.name: w for pair in self.pairs for w in pair.workers}
        self._pair_of = {w.name: pair for pair in self.pairs for w in pair.workers}
        vision = config.encoder and vision_config(config.model_dir) is not None
        self.encoder = ServiceHealth("encoder") if vision else None
        """The vision encoder (a model with a vision tower, `RouterConfig.encoder` given), shared by the pairs
        (a text-only model's encoder, as one docker-compose starts for any model, exits at once)."""
        self.encoder_box: AsyncOutbox | None = None
        if self.encoder is not None:
            self.services[self.encoder.name] = self.encoder
        self._unknown: set[str] = set()
        """Service names heard that no pair has (warned about once each)."""
        self._flights: dict[str, Flight] = {}
        self._running = 0
        self._waiters: deque[tuple[asyncio.Future[None], int]] = deque()
        """Admissions waiting, in arrival order: each for its number of slots (a group's, taken at once)."""
        self._tasks: set[asyncio.Task[Any]] = set()
        self._dropped_seen = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._inbox: AsyncInbox | None = None
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
        for pair, addrs in zip(self.pairs, self.config.pairs, strict=True):
            pair.prefill_box = AsyncOutbox(addrs.prefill, self._ctx, monitor=True)
            pair.decode_box = AsyncOutbox(addrs.decode, self._ctx, monitor=True)
            self._links += [
                asyncio.create_task(self._watch_link(w.name, box), name=f"router-link-{w.name}")
                for w, box in ((pair.prefill, pair.prefill_box), (pair.decode, pair.decode_box))
            ]
        if self.encoder is not None:
            self.encoder_box = AsyncOutbox(self.config.encoder, self._ctx, monitor=True)
            self._links.append(
                asyncio.create_task(self._watch_link("encoder", self.encoder_box), name="router-link-encoder")
            )
        self._reader = asyncio.create_task(self._read_inbox(), name="router-inbox")
        if self._watch_period() > 0:
            self._watchdog = asyncio.create_task(self._watch_stalls(), name="router-watchdog")

    async def close(self) -> None:
        """Abort everything in flight at the workers, then close the sockets."""
        for task in (self._reader, self._watchdog, *self._links):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for flight in list(self._flights.values()):
            self._spawn(self._send_abort(flight.rid, self.pairs[flight.pair], flight.images > 0))
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=1.0)
        boxes = [box for pair in self.pairs for box in (pair.prefill_box, pair.decode_box)]
        boxes.append(self.encoder_box)
        for sock in (self._inbox, *boxes):
            if sock is not None:
                sock.close()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)

    # Health.

    def up_pairs(self) -> list[Pair]:
        """The pairs whose two workers are up (announced themselves and heartbeat in time)."""
        now = time.monotonic()
        return [p for p in self.pairs if p.state(now, self.config.heartbeat_timeout_s) == "up"]

    def ready(self) -> bool:
        """Some pair is up: requests can be served."""
        return bool(self.up_pairs())

    def status(self) -> str:
        """ "ok" (every pair up, and the encoder where there is one), "degraded" (some pair up: serving with
        less capacity, or without images) or "unavailable"."""
        up = len(self.up_pairs())
        if not up:
            return "unavailable"
        return "ok" if up == len(self.pairs) and self.encoder_up() else "degraded"

    def check_images(self, tokens: int) -> None:
        """ApiError 400 for images that take more tokens than the encoder takes in one request."""
        limit = self.encoder.image_tokens if self.encoder is not None else 0
        if limit and tokens > limit:
            message = f"The images take {tokens} tokens; this server encodes at most {limit} for one request."
            raise bad_request(message, "messages", "too_many_image_tokens")

    def encoder_up(self) -> bool:
        """The encoder is up (or there is none: nothing waits for it)."""
        enc = self.encoder
        return enc is None or enc.state(time.monotonic(), self.config.heartbeat_timeout_s) == "up"

    def health(self) -> dict[str, Any]:
        """The `/health` body: each service's state and metrics URL, each pair's state and load, and the
        router's own load."""
        now = time.monotonic()
        timeout = self.config.heartbeat_timeout_s
        services = {}
        for name, svc in self.services.items():
            services[name] = {
                "state": svc.state(now, timeout),
                "pid": svc.pid,
                "capacity": svc.capacity,
                "running": svc.running,
                "waiting": svc.waiting,
                "restarts": svc.restarts,
                "last_seen_s": None if svc.last_seen is None else round(now - svc.last_seen, 3),
                "metrics_url": svc.metrics_url or self.config.metrics_urls.get(name, ""),
            }
        pairs = [
            {
                "prefill": p.prefill.name,
                "decode": p.decode.name,
                "state": p.state(now, timeout),
                "running": p.running,
                "capacity": p.capacity(),
            }
            for p in self.pairs
        ]
        return {
            "status": self.status(),
            "services": services,
            "pairs": pairs,
            "router": {
                "running": self._running,
                "waiting": len(self._waiters),
                "max_running": self.max_running(),
                "max_queue": self.config.max_queue,
            },
        }

    def context_limit(self, configured: int) -> int:
        """The longest prompt + completion to admit: `configured`, or less where a worker announced less."""
        announced = (svc.max_context for svc in self.services.values())
        return min([configured, *(c for c in announced if c > 0)])

    def check_stalls(self) -> None:
        """Fail the requests in flight once for each worker silent past the stall timeout, and each request
        whose events have had a gap past the gap timeout (the watchdog's tick; public so that tests can step
        it)."""
        now = time.monotonic()
        self._fail_gaps(now)
        if self.config.stall_timeout_s <= 0:
            return
        for svc in self.services.values():
            silent = None if svc.last_seen is None else now - svc.last_seen
            if svc.exited or svc.stalled or silent is None or silent <= self.config.stall_timeout_s:
                continue
            svc.stalled = True
            log.error("%s (pid %s) has been silent for %.0f s: taken as hung", svc.name, svc.pid, silent)
            reason = f"the {svc.name} worker stopped responding ({silent:.0f} s without a heartbeat)"
            self._fail_service(svc, reason)

    def _fail_gaps(self, now: float) -> None:
        limit = self.config.event_gap_timeout_s
        if limit <= 0:
            return
        for flight in self._flights.values():
            if flight.gap_since is None or now - flight.gap_since <= limit:
                continue
            flight.lost, flight.gap_since = True, None
            flight.pending.clear()
            log.error(
                "%s: event %d still missing over %.0f s after a later one",
                flight.rid,
                flight.next_index,
                limit,
            )
            reason = (
                f"an event of this request was lost on its way from the workers (index {flight.next_index})"
            )
            flight.events.put_nowait(Tokens(flight.rid, [], "error", error=reason))

    def on_link(self, service: str, up: bool) -> None:
        """The router's connection to `service`'s inbox opened (`up`) or closed. Closed after being open: the
        worker exited (or its host is gone), so the requests in flight fail now, as on the launcher's
        `ServiceDown`, not after the stall timeout (public so that tests can step it)."""
        svc = self.services[service]
        was, svc.linked = svc.linked, up
        if up or not was or svc.exited:
            return
        svc.last_seen = None  # "starting" once the connection is back, until the process behind it speaks
        log.error("%s (pid %s): its connection closed", service, svc.pid)
        self._fail_service(svc, f"the {service} worker's connection closed (it exited)")

    async def _watch_link(self, service: str, outbox: AsyncOutbox) -> None:
        try:
            while True:
                self.on_link(service, await outbox.link_changed())
        except zmq.ZMQError:  # the context is going (close): nothing left to watch
            log.debug("%s: connection monitor ended", service, exc_info=True)

    def _watch_period(self) -> float:
        """Seconds between the watchdog's ticks: a quarter of the shortest timeout, at most 1; 0 = none."""
        timeouts = [t for t in (self.config.stall_timeout_s, self.config.event_gap_timeout_s) if t > 0]
        return min(1.0, *(t / 4 for t in timeouts)) if timeouts else 0.0

    async def _watch_stalls(self) -> None:
        while True:
            await asyncio.sleep(self._watch_period())
            self.check_stalls()

    def max_running(self) -> int:
        """The admission limit: configured, else the capacity of the pairs that are up (each announced by the
        smaller of its two workers), plus the requests the others still hold."""
        if self.config.max_running > 0:
            return self.config.max_running
        up = self.up_pairs()
        # The requests of a pair that is down but not failed yet (silent, not past the stall timeout) keep
        # their slots, so that they do not take the pairs that are up below their capacity.
        held = sum(p.running for p in self.pairs if p not in up)
        return sum(p.capacity() for p in up) + held or DEFAULT_MAX_RUNNING

    # Admission.

    async def submit(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        received: float,
        rid: str | None = None,
        images: Sequence[bytes] = (),
    ) -> Flight:
        """Admit a request (waiting for a slot) and send it to prefill, its `images` (files, in the prompt's
        order) to the encoder; raises ApiError 503 / 429.

        `received` is the request's arrival, time.monotonic(); `rid` its id (default: a new one).
        Cancelling the caller while it waits gives its place up; cancelling it after admission aborts the
        request at the workers.
        """
        (flight,) = await self.submit_group(
            prompt_ids, [sampling], received, [rid or uuid.uuid4().hex], images
        )
        return flight

    async def submit_group(
        self,
        prompt_ids: list[int],
        samplings: list[SamplingParams],
        received: float,
        rids: list[str],
        images: Sequence[bytes] = (),
    ) -> list[Flight]:
        """`submit` for choices of one prompt that differ in their seeds only, prefilled once (each in a slot
        of its own, admitted together: at most `max_group()`): a flight each, in order."""
        self._refuse_unless_ready()
        if images and not self.encoder_up():
            raise ApiError(503, "The vision encoder is not ready.", type="server_error", code="not_ready")
        queued = time.monotonic()
        await self._take_slots(len(rids))
        up = [p for p in self.up_pairs() if len(rids) == 1 or p.capacity() >= len(rids)]
        if not up:  # every pair went down while this request waited: the slots pass on
            self._free_slots(len(rids))
            raise _not_ready()
        self.metrics.queue_time.observe(time.monotonic() - queued)
        pair = min(up, key=Pair.load)
        pair.running += len(rids)
        pair.sent += 1
        self._update_gauges()
        flights = [
            Flight(rid, prompt_ids, sampling, received, pair=pair.index, images=len(images) if i == 0 else 0)
            for i, (rid, sampling) in enumerate(zip(rids, samplings, strict=True))
        ]
        self._flights.update((f.rid, f) for f in flights)
        primary = flights[0]
        try:
            assert pair.prefill_box is not None, "RouterCore.start() was not called"
            if images:
                assert self.encoder_box is not None
                await self.encoder_box.send(Encode(primary.rid, list(images), pair.prefill.name))
            siblings = [Sibling(f.rid, f.sampling.seed) for f in flights[1:]]
            gen = Generate(primary.rid, prompt_ids, primary.sampling, arrival=primary.arrival,
                           images=len(images), siblings=siblings)  # fmt: skip
            await pair.prefill_box.send(gen)
        except BaseException:
            for flight in flights:
                self.release(flight, None)
            raise
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        return flights

    def max_group(self) -> int:
        """The most choices of one prompt that can share its prefill: decode grants their lanes together, so
        no more than the smallest pair up runs (and the admission limit lets in at once)."""
        lanes = [p.capacity() for p in self.up_pairs() if p.capacity() > 0]
        return max(1, min([self.max_running(), *lanes]))

    def _refuse_unless_ready(self) -> None:
        if not self.ready():
            raise _not_ready()

    async def _take_slots(self, count: int) -> None:
        """Take `count` admission slots at once, waiting in arrival order (one waiter for a group: no group
        holds some slots while it waits for the rest, which two groups could do to each other for good);
        raises ApiError 429 when the queue is full. Cancelled, it takes none."""
        if not self._waiters and self._running + count <= self.max_running():
            self._running += count
            self._update_gauges()
            return
        if len(self._waiters) >= self.config.max_queue:
            raise ApiError(
                429,
                f"The server is busy: {self._running} requests running and {len(self._waiters)} waiting.",
                type="rate_limit_error",
                code="queue_full",
            )
        waiter = (asyncio.get_running_loop().create_future(), count)
        self._waiters.append(waiter)
        self._update_gauges()
        try:
            await waiter[0]
        except asyncio.CancelledError:
            if waiter[0].done() and not waiter[0].cancelled():
                self._free_slots(count)  # handed to us as we were cancelled: pass them on
            else:
                self._waiters.remove(waiter)
                self._admit_waiters()  # the next may fit where this one did not
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
        pair = self.pairs[flight.pair]
        pair.running -= 1
        if not flight.worker_done:
            self._spawn(self._send_abort(flight.rid, pair, to_encoder=flight.images > 0))
        if finish_reason is not None:
            self.metrics.requests_finished.labels(finish_reason=finish_reason).inc()
            self.metrics.e2e_request_latency.observe(time.monotonic() - flight.received)
        self._free_slots(1)

    def _free_slots(self, count: int) -> None:
        """Give back `count` slots: they pass to the waiters at the head that fit."""
        self._running -= count
        self._admit_waiters()

    def _admit_waiters(self) -> None:
        """Start waiters in arrival order while the limit allows (it also rises when workers announce their
        capacity). A group larger than the limit (which fell since it was admitted to wait) is refused."""
        while self._waiters:
            slot, count = self._waiters[0]
            limit = self.max_running()
            if slot.done():  # cancelled
                self._waiters.popleft()
            elif count > limit:
                self._waiters.popleft()
                slot.set_exception(
                    ApiError(503, f"{count} choices cannot run together now (at most {limit}).",
                             type="server_error", code="not_ready")
                )  # fmt: skip
            elif self._running + count <= limit:
                self._waiters.popleft()
                self._running += count
                slot.set_result(None)
            else:
                break
        self._update_gauges()

    def _update_gauges(self) -> None:
        self.metrics.requests_running.set(self._running)
        self.metrics.requests_waiting.set(sum(count for _, count in self._waiters))

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
            self.sync_dropped_frames()  # (for --metrics-port's server too, which renders the registry alone)
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

    def _service(self, name: str) -> ServiceHealth | None:
        """The worker `name` names, or None (warned about once) for a name no pair has: a worker started
        with another router's pairs must not fail this router's requests."""
        svc = self.services.get(name)
        if svc is None and name not in self._unknown:
            self._unknown.add(name)
            log.warning("ignoring messages of %r: no pair of this router has a worker of that name", name)
        return svc

    def _on_down(self, msg: ServiceDown) -> None:
        svc = self._service(msg.service)
        if svc is not None and svc.pid == msg.pid and not svc.exited:
            svc.exited = True
            log.error("%s (pid %d) exited with %d", msg.service, msg.pid, msg.exit_code)
            self._fail_service(svc, f"the {msg.service} worker exited (code {msg.exit_code})")

    def _on_alive(self, msg: Ready | Heartbeat) -> None:
        svc = self._service(msg.service)
        if svc is None:
            return
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
            self._fail_service(svc, f"the {msg.service} worker restarted (pid {svc.pid} → {msg.pid})")
        svc.pid, svc.instance = msg.pid, msg.instance
        svc.last_seen = time.monotonic()
        svc.image_tokens = msg.image_tokens or svc.image_tokens
        if isinstance(msg, Ready):
            svc.capacity, svc.max_context = msg.capacity, msg.max_context
            svc.metrics_url = msg.metrics_url or svc.metrics_url
            log.info("%s is ready (pid %d, capacity %d)", msg.service, msg.pid, msg.capacity)
        else:
            svc.running, svc.waiting = msg.running, msg.waiting
            if msg.capacity and not svc.capacity:  # a router restarted after the worker's Ready
                svc.capacity, svc.max_context = msg.capacity, msg.max_context
        # Its pair may be up again (Ready, heard after a stall or a reopened connection): the limit rose.
        self._admit_waiters()

    def _fail_service(self, svc: ServiceHealth, reason: str) -> None:
        """`svc` died (exited, restarted, hung): fail what it held. A pair's worker: the pair's requests. The
        encoder: the requests whose images it may have held (those without a first token yet; prefill
        would wait for their embeddings for good)."""
        if svc is not self.encoder:
            self._fail_pair(self._pair_of[svc.name], reason)
            return
        for flight in self._flights.values():
            if flight.images and flight.next_index == 0:
                flight.events.put_nowait(Tokens(flight.rid, [], "error", error=reason))

    def _fail_pair(self, pair: Pair, reason: str) -> None:
        """The requests `pair` runs died with one of its workers: end each with an error event."""
        for flight in self._flights.values():
            if flight.pair == pair.index:
                flight.events.put_nowait(Tokens(flight.rid, [], "error", error=reason))

    def _on_tokens(self, event: Tokens) -> None:
        flight = self._flights.get(event.rid)
        if flight is None:
            self._abort_orphan(event)
            return
        if event.finish_reason in TERMINAL_ERRORS:
            flight.events.put_nowait(event)
            return
        if flight.lost:
            return
        if event.index < flight.next_index:
            log.warning("dropping a duplicate event of %s at index %d", event.rid, event.index)
            return
        flight.pending.setdefault(event.index, []).append(event)
        expected = flight.next_index
        while flight.next_index in flight.pending:
            for ready in flight.pending.pop(flight.next_index):
                self._deliver(flight, ready)
        if not flight.pending:
            flight.gap_since = None
        elif flight.gap_since is None or flight.next_index != expected:  # a gap, or a new one further on
            flight.gap_since = time.monotonic()

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
        for pair in self.pairs:  # which pair sent it is not known
            self._spawn(self._send_abort(event.rid, pair))

    async def _send_abort(self, rid: str, pair: Pair, to_encoder: bool = False) -> None:
        boxes = [pair.prefill_box, pair.decode_box, *([self.encoder_box] if to_encoder else [])]
        for outbox in boxes:
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


def _not_ready() -> ApiError:
    return ApiError(503, "The model workers are not ready.", type="server_error", code="not_ready")
