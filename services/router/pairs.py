"""What the router knows of its workers: each one's health (`ServiceHealth`, from its `Ready` and
`Heartbeat` messages and its connection) and each prefill/decode pair's (`Pair`: up when both are)."""

from __future__ import annotations

from dataclasses import dataclass

from common.ipc.transport import AsyncOutbox


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
    progressed: float | None = None
    """time.monotonic() when its loop last came round (`Heartbeat.loop_s` before its last message; the beats
    come from a thread of their own): silent past the stall timeout, it is hung."""
    running: int = 0
    waiting: int = 0
    restarts: int = 0
    max_context: int = 0
    """The context it announced in `Ready` (0: none of its own)."""
    image_tokens: int = 0
    """The encoder's bound on one request's image tokens, as it announced it (0: not known)."""
    exited: bool = False
    """The launcher reported the process `pid` dead; cleared by a `Ready` from its successor."""
    stalled: bool = False
    """Silent past the stall timeout (its requests were failed); cleared when it is heard again."""
    linked: bool | None = None
    """Whether the router's connection to its inbox is open (None: not yet). An exit closes it at once: the
    requests in flight fail then, where no launcher reports the exit (one container a service); the
    service is down, then starting, until the process behind the new connection speaks."""

    lost: str = ""
    """Why it last went down (exited, stalled, its connection closed), for the logs; kept once it is up."""

    def idle(self, now: float) -> float | None:
        """Seconds at `now` since its loop was last known to come round (None: never heard): since its last
        message, or longer where that said the loop had been silent before."""
        if self.last_seen is None:
            return None
        return now - min(self.last_seen, self.progressed if self.progressed is not None else self.last_seen)

    def state(self, now: float, timeout_s: float) -> str:
        """ "starting" (never heard), "up", or "down" (exited, stalled, its connection closed, or silent for
        longer than `timeout_s`)."""
        if self.exited or self.stalled or self.linked is False:
            return "down"
        if self.last_seen is None:
            return "starting"
        return "up" if now - self.last_seen <= timeout_s else "down"

    def why(self, now: float, timeout_s: float) -> str:
        """Its state at `now`, with the reason where it is not up: "down: exited with code -9"."""
        state = self.state(now, timeout_s)
        if state == "starting":
            return "starting: not heard from yet"
        if state == "up":
            return "up"
        if self.exited or self.stalled or self.linked is False:
            return f"down: {self.lost}"
        assert self.last_seen is not None  # (down by silence)
        return f"down: no heartbeat for {now - self.last_seen:.1f} s"


@dataclass
class Pair:
    """One prefill worker and the decode worker it hands to, as the router drives them."""

    index: int
    """Its place in `RouterConfig.pairs`."""
    prefill: ServiceHealth
    decode: ServiceHealth
    prefill_box: AsyncOutbox | None = None
    """The router's connection to the prefill worker's inbox (`Generate`, `Abort`); None before `start`."""
    decode_box: AsyncOutbox | None = None
    """... to the decode worker's (`Abort`)."""
    running: int = 0
    """Requests the router has sent it that have not ended."""
    sent: int = 0
    """Requests sent to it in all: of two pairs equally loaded, the one sent fewer gets the next (in turns,
    so that requests one at a time do not all go to the first pair)."""

    @property
    def workers(self) -> tuple[ServiceHealth, ServiceHealth]:
        return self.prefill, self.decode

    def state(self, now: float, timeout_s: float) -> str:
        """ "up" when both workers are, "down" when either is, else "starting"."""
        states = {w.state(now, timeout_s) for w in self.workers}
        if states == {"up"}:
            return "up"
        return "down" if "down" in states else "starting"

    def why(self, now: float, timeout_s: float) -> str:
        """ "pair 0 down (decode-0 down: exited with code -9)": its state and each worker's that is not up."""
        parts = [f"{w.name} {w.why(now, timeout_s)}" for w in self.workers if w.state(now, timeout_s) != "up"]
        detail = f" ({'; '.join(parts)})" if parts else ""
        return f"pair {self.index} {self.state(now, timeout_s)}{detail}"

    def capacity(self) -> int:
        """The requests it can run: the smaller announced capacity of its two workers (0: none announced)."""
        known = [w.capacity for w in self.workers if w.capacity > 0]
        return min(known, default=0)

    def load(self) -> tuple[float, int]:
        """Its share of its capacity in use, then its requests sent: the router sends a request to the pair
        for which this is least."""
        return self.running / max(self.capacity(), 1), self.sent
