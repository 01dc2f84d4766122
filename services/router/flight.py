"""A request the workers are running, as the router tracks it (`Flight`): its parameters, the pair running
it, and the queue its events reach in generation order."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from common.protocol import SamplingParams, Tokens


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
    """The `Tokens.index` of the next event to deliver: the tokens delivered so far."""
    pending: dict[int, list[Tokens]] = field(default_factory=dict)
    """Events that arrived ahead of their turn, by `Tokens.index`."""
    gap_since: float | None = None
    """time.monotonic() since when `pending` has held events (None while it is empty)."""
    lost: bool = False
    """Its gap outlived `event_gap_timeout_s`: it was failed, and its later events are dropped."""
    last_token_at: float | None = None
    """time.monotonic() of its last delivered token (None before the first)."""
    decoding: bool = False
    """An event of decode's came (`Tokens.index` > 0: prefill sends the first token only): decode holds the
    request, and a death of its prefill worker no longer touches it."""
    released: bool = False
    """The router is done with it (`RouterCore.release`): its slot is free."""
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

    def fail(self, reason: str) -> None:
        """Queue an error event carrying `reason`: whoever reads its events ends the request there."""
        self.events.put_nowait(Tokens(self.rid, [], "error", error=reason))
