"""The router's core: library code with no HTTP in it (the FastAPI app in `app.py` is a thin shell around it),
so it can be driven directly.

`RouterCore` composes four collaborators and keeps the interface the app and the tests use:
`Supervisor` (the workers' health and the pairs they form), `Admission` (slots, the queue, the limits and
the choice of a pair), `EventDelivery` (the inbox, and each request's events in order) and `WorkerLinks`
(the connections to the workers). One task reads the inbox; a watchdog task fails the requests of a worker
silent past `stall_timeout_s` and those whose events have a gap past `event_gap_timeout_s`.

A worker's exit, stall, restart or closed connection fails the requests of its pair only; the router serves
while any pair is up. Every request that ends before the workers finished it (client gone, stop string,
error, router shutdown) is aborted at its pair's workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

import zmq.asyncio

from common.metrics import RouterMetrics
from common.protocol import (
    Encode,
    Generate,
    Heartbeat,
    Message,
    PairMoved,
    Ready,
    SamplingParams,
    ServiceDown,
    Sibling,
    Tokens,
)
from services.router.admission import Admission
from services.router.config import RouterConfig
from services.router.delivery import EventDelivery
from services.router.flight import Flight
from services.router.links import WorkerLinks
from services.router.pairs import Pair
from services.router.supervision import Supervisor, watch_period

log = logging.getLogger(__name__)

__all__ = ["Flight", "RouterCore"]


class RouterCore:
    """Admission, dispatch and health of the router; `start` binds its sockets, `close` releases them."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.supervisor = Supervisor(config, self._on_failure, metrics)
        self.links = WorkerLinks(
            config, self.supervisor.pairs, self.supervisor.encoder is not None, self.supervisor.on_link
        )
        self.delivery = EventDelivery(config, metrics, self.links.abort_everywhere)
        self.admission = Admission(config, metrics, self.supervisor)
        self.pairs = self.supervisor.pairs
        self.services = self.supervisor.services
        self.encoder = self.supervisor.encoder
        """The vision encoder's health (None: no encoder to wait for), shared by the pairs."""
        self._ctx: zmq.asyncio.Context | None = None
        self._reader: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None

    # Lifecycle.

    async def start(self) -> None:
        """Bind the inbox, connect to the workers, start reading (inside the serving event loop)."""
        self._ctx = zmq.asyncio.Context()
        self.delivery.open(self._ctx)
        self.links.open(self._ctx)
        self._reader = asyncio.create_task(self.delivery.read(self.on_message), name="router-inbox")
        if watch_period(self.config) > 0:
            self._watchdog = asyncio.create_task(self._watch_stalls(), name="router-watchdog")

    async def close(self) -> None:
        """Abort everything in flight at the workers, then close the sockets."""
        for task in (self._reader, self._watchdog):
            await _cancel(task)
        await self.links.stop_watching()
        for flight in list(self.delivery.flights.values()):
            self.links.abort(flight.rid, self.pairs[flight.pair], flight.images > 0)
        await self.links.drain(timeout_s=1.0)
        self.delivery.close()
        self.links.close()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)

    async def _watch_stalls(self) -> None:
        while True:
            await asyncio.sleep(watch_period(self.config))
            self.check_stalls()
            self.sync_dropped_frames()  # refused connections bring no message to wake the reader

    # Health.

    def up_pairs(self) -> list[Pair]:
        """The pairs whose two workers are up (announced themselves and heartbeat in time)."""
        return self.supervisor.up_pairs()

    def ready(self) -> bool:
        """Some pair is up: requests can be served."""
        return self.supervisor.ready()

    def status(self) -> str:
        """ "ok", "degraded" or "unavailable" (`Supervisor.status`)."""
        return self.supervisor.status()

    def encoder_up(self) -> bool:
        """The encoder is up (or there is none: nothing waits for it)."""
        return self.supervisor.encoder_up()

    def health(self) -> dict[str, Any]:
        """The `/health` body: each service's state and metrics URL, each pair's state and load, and the
        router's own load, and how often its launcher restarted it."""
        return {
            "status": self.status(),
            "services": self.supervisor.service_report(),
            "pairs": self.supervisor.pair_report(),
            "router": self.admission.report(),
            "router_restarts": self.config.restarts.get("router", 0),
        }

    def context_limit(self, configured: int) -> int:
        """The longest prompt + completion to admit: `configured`, or less where a worker announced less."""
        return self.supervisor.context_limit(configured)

    def check_stalls(self) -> None:
        """Fail the requests in flight once for each worker silent past the stall timeout, and each request
        whose events have had a gap past the gap timeout (the watchdog's tick; public so that tests can step
        it)."""
        now = time.monotonic()
        self.delivery.fail_gaps(now)
        self.supervisor.check_stalls(now)

    def on_link(self, service: str, up: bool) -> None:
        """The router's connection to `service`'s inbox opened (`up`) or closed (`Supervisor.on_link`;
        public so that tests can step it)."""
        self.supervisor.on_link(service, up)

    def sync_dropped_frames(self) -> None:
        """Carry the inbox's count of undecodable frames into the metrics (called before a scrape)."""
        self.delivery.sync_dropped_frames()

    # Admission.

    def max_running(self) -> int:
        """The admission limit (`Admission.max_running`)."""
        return self.admission.max_running()

    def max_group(self) -> int:
        """The most choices of one prompt that can share its prefill (`Admission.max_group`)."""
        return self.admission.max_group()

    def check_images(self, tokens: int) -> None:
        """ApiError 400 for images that take more tokens than the encoder takes in one request."""
        self.admission.check_images(tokens)

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
        pair = await self.admission.admit(len(rids), bool(images))
        flights = [
            Flight(rid, prompt_ids, sampling, received, pair=pair.index, images=len(images) if i == 0 else 0)
            for i, (rid, sampling) in enumerate(zip(rids, samplings, strict=True))
        ]
        self.delivery.track(flights)
        primary = flights[0]
        try:
            encode = Encode(primary.rid, list(images), pair.prefill.name) if images else None
            siblings = [Sibling(f.rid, f.sampling.seed) for f in flights[1:]]
            gen = Generate(primary.rid, prompt_ids, primary.sampling, arrival=primary.arrival,
                           images=len(images), siblings=siblings)  # fmt: skip
            await self.links.send(pair, gen, encode)
        except BaseException:
            for flight in flights:
                self.release(flight, None)
            raise
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        return flights

    def release(self, flight: Flight, finish_reason: str | None) -> None:
        """The request is over for the router: free its slot; abort it at the workers if they may hold it.

        `finish_reason` is what the client was told (None when it ended in an error or disconnect).
        Synchronous, so that it can run in the `finally` of a cancelled task.
        """
        if flight.released:
            return
        flight.released = True
        self.delivery.forget(flight.rid)
        pair = self.pairs[flight.pair]
        if not flight.worker_done:
            self.links.abort(flight.rid, pair, to_encoder=flight.images > 0)
        if finish_reason is not None:
            self.metrics.requests_finished.labels(finish_reason=finish_reason).inc()
            self.metrics.e2e_request_latency.observe(time.monotonic() - flight.received)
        self.admission.release(pair)

    # Dispatch.

    def on_message(self, msg: Message, sender: str | None = None) -> None:
        """Apply one inbox message from the service `sender` (None: not known, no keys; public so that tests
        and tools can feed the core directly). Tokens count only from a worker of the request's pair, or the
        encoder (the inbox took each message from a role that may send it)."""
        if isinstance(msg, Tokens):
            if sender is not None and not self._may_tell(sender, msg.rid):
                self.delivery.reject(msg, sender)
                return
            self.delivery.on_tokens(msg)
        elif isinstance(msg, Ready | Heartbeat):
            if self.supervisor.on_alive(msg):  # its pair may be up again: the limit may have risen
                self.admission.admit_waiters()
        elif isinstance(msg, ServiceDown):
            self.supervisor.on_down(msg)
        elif isinstance(msg, PairMoved) and 0 <= msg.index < len(self.pairs):
            self.links.move(self.pairs[msg.index], msg.prefill, msg.decode)
            self.supervisor.on_moved(self.pairs[msg.index])
        else:
            log.warning("router ignores %s messages", type(msg).__name__)

    def _may_tell(self, sender: str, rid: str) -> bool:
        """Whether the service `sender` may send events of request `rid`: the encoder, or a worker of the pair
        that runs it (any pair's worker for a request the router does not hold: an orphan, aborted)."""
        flight = self.delivery.flights.get(rid)
        return (
            sender == "encoder"
            or flight is None
            or sender in {w.name for w in self.pairs[flight.pair].workers}
        )

    def _on_failure(self, pair: Pair | None, reason: str, prefill: bool) -> None:
        """A worker of `pair` died (None: the encoder; `prefill`: the pair's prefill worker): fail the
        requests it may have held (a prefill worker's death spares those decode holds already)."""
        if pair is None:
            self.delivery.fail_awaiting_images(reason)
        else:
            self.delivery.fail_pair(pair.index, reason, spare_decoding=prefill)


async def _cancel(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
