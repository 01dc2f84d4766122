"""Admission: which requests run now, which wait, which are refused, and on which pair each runs.

At most `max_running()` requests are in flight to the workers; up to `RouterConfig.max_queue` more wait here
in arrival order (their clients see nothing until a slot frees); beyond that, 429. Workers not ready, or
images with no encoder up, are 503; images past the encoder's bound are 400. An admitted request goes to the
up pair with the smallest share of its capacity in use.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from common.metrics import RouterMetrics
from common.openai.api import ApiError, bad_request
from services.router.config import RouterConfig
from services.router.pairs import Pair
from services.router.supervision import Supervisor

log = logging.getLogger(__name__)

DEFAULT_MAX_RUNNING = 64
"""The admission limit when `max_running` is 0 and no worker has announced a capacity."""


def not_ready(reason: str) -> ApiError:
    """The 503 for a request that no pair can take now, logged with `reason` (each pair's state)."""
    log.warning("503 not_ready: %s", reason)
    return ApiError(503, "The model workers are not ready.", type="server_error", code="not_ready")


class Admission:
    """The admission slots (`running` taken, the waiters in arrival order) and the limits they obey; it
    reads the pairs' states and capacities from `supervisor` and keeps the running/waiting gauges."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics, supervisor: Supervisor) -> None:
        self.config = config
        self.metrics = metrics
        self.supervisor = supervisor
        self.running = 0
        """Slots taken: requests admitted and not released."""
        self._waiters: deque[tuple[asyncio.Future[None], int]] = deque()
        """Admissions waiting, in arrival order: each for its number of slots (a group's, taken at once)."""

    # Limits.

    def max_running(self) -> int:
        """The admission limit: configured, else the capacity of the pairs that are up (each announced by the
        smaller of its two workers), plus the requests the others still hold."""
        if self.config.max_running > 0:
            return self.config.max_running
        up = self.supervisor.up_pairs()
        # The requests of a pair that is down but not failed yet (silent, not past the stall timeout) keep
        # their slots, so that they do not take the pairs that are up below their capacity.
        held = sum(p.running for p in self.supervisor.pairs if p not in up)
        return sum(p.capacity() for p in up) + held or DEFAULT_MAX_RUNNING

    def max_group(self) -> int:
        """The most choices of one prompt that can share its prefill: decode grants their lanes together, so
        no more than the smallest pair up runs (and the admission limit lets in at once)."""
        lanes = [p.capacity() for p in self.supervisor.up_pairs() if p.capacity() > 0]
        return max(1, min([self.max_running(), *lanes]))

    def check_images(self, tokens: int) -> None:
        """ApiError 400 for images that take more tokens than the encoder takes in one request."""
        encoder = self.supervisor.encoder
        limit = encoder.image_tokens if encoder is not None else 0
        if limit and tokens > limit:
            message = f"The images take {tokens} tokens; this server encodes at most {limit} for one request."
            raise bad_request(message, "messages", "too_many_image_tokens")

    def report(self) -> dict[str, Any]:
        """`/health`'s router section: slots taken, admissions waiting, and the limits."""
        return {
            "running": self.running,
            "waiting": len(self._waiters),
            "max_running": self.max_running(),
            "max_queue": self.config.max_queue,
        }

    # Slots.

    async def admit(self, count: int, images: bool) -> Pair:
        """Take `count` slots (one request, or a group of choices admitted together) and the pair to run
        them, whose `running` and `sent` count them; raises ApiError 503 (no pair up, or `images` with no
        encoder up) or 429 (the queue is full). Cancelled while it waits, it takes nothing."""
        if not self.supervisor.ready():
            raise not_ready(self.supervisor.unready_reason())
        if images and not self.supervisor.encoder_up():
            log.warning("503 not_ready for a request with images: the vision encoder is not up")
            raise ApiError(503, "The vision encoder is not ready.", type="server_error", code="not_ready")
        queued = time.monotonic()
        await self._take_slots(count)
        up = [p for p in self.supervisor.up_pairs() if count == 1 or p.capacity() >= count]
        if not up:  # every pair went down while this request waited: the slots pass on
            self._free_slots(count)
            raise not_ready(self.supervisor.unready_reason())
        self.metrics.queue_time.observe(time.monotonic() - queued)
        pair = min(up, key=Pair.load)
        pair.running += count
        pair.sent += 1
        self._update_gauges()
        return pair

    def release(self, pair: Pair) -> None:
        """One request `pair` ran is over: its slot passes to the waiters at the head that fit."""
        pair.running -= 1
        self._free_slots(1)

    def admit_waiters(self) -> None:
        """Start waiters in arrival order while the limit allows (call it when the limit may have risen:
        a pair up again, a capacity announced). A group larger than the limit (which fell since it was
        admitted to wait) is refused with 503."""
        while self._waiters:
            slot, count = self._waiters[0]
            limit = self.max_running()
            if slot.done():  # cancelled
                self._waiters.popleft()
            elif count > limit:
                self._waiters.popleft()
                log.warning("503 not_ready: %d choices together, over the limit of %d now", count, limit)
                slot.set_exception(
                    ApiError(503, f"{count} choices cannot run together now (at most {limit}).",
                             type="server_error", code="not_ready")
                )  # fmt: skip
            elif self.running + count <= limit:
                self._waiters.popleft()
                self.running += count
                slot.set_result(None)
            else:
                break
        self._update_gauges()

    async def _take_slots(self, count: int) -> None:
        """Take `count` admission slots at once, waiting in arrival order (one waiter for a group: no group
        holds some slots while it waits for the rest, which two groups could do to each other for good);
        raises ApiError 429 when the queue is full. Cancelled, it takes none."""
        if not self._waiters and self.running + count <= self.max_running():
            self.running += count
            self._update_gauges()
            return
        if len(self._waiters) >= self.config.max_queue:
            raise ApiError(
                429,
                f"The server is busy: {self.running} requests running and {len(self._waiters)} waiting.",
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
                self.admit_waiters()  # the next may fit where this one did not
            raise

    def _free_slots(self, count: int) -> None:
        """Give back `count` slots: they pass to the waiters at the head that fit."""
        self.running -= count
        self.admit_waiters()

    def _update_gauges(self) -> None:
        self.metrics.requests_running.set(self.running)
        self.metrics.requests_waiting.set(sum(count for _, count in self._waiters))
