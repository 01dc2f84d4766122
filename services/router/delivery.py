"""Event delivery: the router's inbox, and each `Tokens` event to the queue of the request it names.

A request's events reach its queue in the order of `Tokens.index` (prefill's first token and decode's later
ones travel on different connections, so they may arrive out of turn); duplicates are dropped, and an error
or abort overtakes the tokens waiting for their turn. A gap that outlives `event_gap_timeout_s` (an event
lost on the way) fails the request. Tokens of a request the router does not hold are orphans: aborted at
the workers, once each. Frames the inbox could not decode are counted in the metrics.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable

import zmq.asyncio

from common.ipc.transport import AsyncInbox
from common.metrics import RefusalCount, RouterMetrics
from common.protocol import Message, Tokens
from services.router.config import RouterConfig
from services.router.flight import Flight

log = logging.getLogger(__name__)

TERMINAL_ERRORS = ("error", "abort")
ORPHANS_REMEMBERED = 4096
"""Requests aborted for orphaned tokens that the router remembers, so that each is aborted once."""


class EventDelivery:
    """The requests in flight (`flights`, by id) and the events bound for them; the inbox they come on.

    `abort_orphan(rid)` is called once for each request whose tokens nobody here waits for (a late event of
    one the router ended, or one a previous router sent), so that the workers stop generating it.
    """

    def __init__(
        self, config: RouterConfig, metrics: RouterMetrics, abort_orphan: Callable[[str], None]
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.flights: dict[str, Flight] = {}
        self.inbox: AsyncInbox | None = None
        """The router's inbox (bound by `open`), on which every worker's messages arrive."""
        self._abort_orphan = abort_orphan
        self._dropped_seen = 0
        self._refusals = RefusalCount(metrics.control_refused)
        self._orphans: deque[str] = deque(maxlen=ORPHANS_REMEMBERED)
        """Requests aborted for tokens nobody waits for (the latest; as decode's `gone`)."""

    # The inbox.

    def open(self, ctx: zmq.asyncio.Context) -> None:
        """Bind the inbox at `RouterConfig.inbox`."""
        self.inbox = AsyncInbox(self.config.inbox, ctx, keys=self.config.control_keys)

    def close(self) -> None:
        if self.inbox is not None:
            self.inbox.close()

    async def read(self, handle: Callable[[Message, str | None], None]) -> None:
        """Hand each message of the inbox, with its sender (None without keys), to `handle`, for good (an
        exception it raises is logged: a bad message must not stop the router)."""
        assert self.inbox is not None, "EventDelivery.open() was not called"
        while True:
            sender, msg = await self.inbox.recv_from()
            self.sync_dropped_frames()  # (for --metrics-port's server too, which renders the registry alone)
            try:
                handle(msg, sender)
            except Exception:
                log.exception("failed to handle %r", msg)

    def sync_dropped_frames(self) -> None:
        """Carry the inbox's counts of undecodable frames, refused connections and rejected messages into the
        metrics (called before a scrape, and by the watchdog)."""
        if self.inbox is None:
            return
        if self.inbox.dropped > self._dropped_seen:
            self.metrics.dropped_frames.inc(self.inbox.dropped - self._dropped_seen)
            self._dropped_seen = self.inbox.dropped
        self._refusals.sync(self.inbox.refused, self.inbox.rejected)

    def reject(self, msg: Message, sender: str) -> None:
        """`msg` came from `sender`, which may not send it (a worker's events for another pair's request):
        dropped, logged and counted."""
        log.warning("rejected a %s from %s: not its to send", type(msg).__name__, sender)
        self.metrics.control_refused.labels(reason="sender").inc()

    # Requests.

    def track(self, flights: Iterable[Flight]) -> None:
        """Deliver the events of `flights` from now on."""
        self.flights.update((f.rid, f) for f in flights)

    def forget(self, rid: str) -> None:
        """Stop delivering `rid`'s events (its later tokens are orphans)."""
        self.flights.pop(rid, None)

    def fail_pair(self, pair: int, reason: str, spare_decoding: bool = False) -> None:
        """The requests pair number `pair` runs died with one of its workers: end each with an error; with
        `spare_decoding` (its prefill worker died), not those its decode worker holds (`Flight.decoding`):
        they go on to their end."""
        for flight in self.flights.values():
            if flight.pair == pair and not (spare_decoding and flight.decoding):
                flight.fail(reason)

    def fail_awaiting_images(self, reason: str) -> None:
        """The encoder died: end with an error the requests whose images it may have held (those with images
        and no first token yet; prefill would wait for their embeddings for good)."""
        for flight in self.flights.values():
            if flight.images and flight.next_index == 0:
                flight.fail(reason)

    def fail_gaps(self, now: float) -> None:
        """End with an error each request whose events have had a gap since longer than the gap timeout at
        `now` (time.monotonic()); its later events are dropped. No-op when the timeout is 0."""
        limit = self.config.event_gap_timeout_s
        if limit <= 0:
            return
        for flight in self.flights.values():
            if flight.gap_since is None or now - flight.gap_since <= limit:
                continue
            flight.lost, flight.gap_since = True, None
            flight.pending.clear()
            log.error("%s: event %d still missing over %.0f s after a later one", flight.rid,
                      flight.next_index, limit)  # fmt: skip
            flight.fail(
                f"an event of this request was lost on its way from the workers (index {flight.next_index})"
            )

    # Events.

    def on_tokens(self, event: Tokens) -> None:
        """Deliver `event` in its turn: now, with those it lets follow, or once the events before it came."""
        flight = self.flights.get(event.rid)
        if flight is None:
            self._orphan(event)
        elif event.finish_reason in TERMINAL_ERRORS:
            flight.events.put_nowait(event)
        elif flight.lost:  # failed for an event that never came: the rest is dropped
            return
        elif event.index < flight.next_index:
            log.warning("dropping a duplicate event of %s at index %d", event.rid, event.index)
        else:
            self._reorder(flight, event)

    def _reorder(self, flight: Flight, event: Tokens) -> None:
        """Hold `event` until its turn, deliver what is in turn, and time the gap that remains."""
        flight.decoding = flight.decoding or event.index > 0  # prefill sends a request's first token only
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
        """Put `event` on the request's queue, timing its tokens (TTFT, inter-token latency)."""
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

    def _orphan(self, event: Tokens) -> None:
        """Tokens of a request this router does not hold would keep a lane and its pages busy up to
        max_tokens for nobody: abort it, once per request (a finished one needs nothing)."""
        if event.finish_reason is not None or event.rid in self._orphans:
            return
        self._orphans.append(event.rid)
        self._abort_orphan(event.rid)
