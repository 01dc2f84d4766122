"""StateGrants: the state decode hands prefill, from the ask to the hand-over.

Prefill asks for a request's state (`AllocState`, with the request's siblings: the other choices of its
prompt); an ask waits in order until lanes and pages free up, then takes them all or none. The request's
state is granted to prefill, which writes the prompt's state into it; the siblings' states are reserved
until `PrefillDone` copies the prompt's state into them. Decode's core owns the running lanes and the cache
freeze; this module keeps the asks and the states on their way to a lane.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection

from common.kv.state import PoolExhausted, SequenceState, StatePool
from common.protocol import AllocState, StateGranted

GONE_RIDS = 4096
"""Aborted requests decode remembers without having seen them (their asks may still come)."""


class StateGrants:
    """Asks that wait, states granted to prefill and siblings' reserved states, over one state pool."""

    def __init__(self, pool: StatePool, max_running: int) -> None:
        self.pool, self.max_running = pool, max_running
        self.pending: deque[AllocState] = deque()  # asks that wait for a free lane or pages
        self.granted: dict[str, SequenceState] = {}  # state handed to prefill, not yet running
        self.reserved: dict[str, tuple[str, SequenceState]] = {}
        """Siblings' states (`AllocState.siblings`), granted with the request whose prompt they share: by the
        sibling's id, that request's id and the state, until its PrefillDone copies the prompt's into it."""
        self.aborted: set[str] = set()  # granted, then aborted: the pages wait for prefill to give them back
        self.gone: deque[str] = deque(maxlen=GONE_RIDS)
        """Requests aborted before their ask arrived (the router's Abort and prefill's AllocState travel
        apart): an ask for one is refused, not granted to run unseen until max_tokens."""

    def refusal(self, ask: AllocState, max_context: int, running: Collection[str]) -> str | None:
        """Why `ask` is refused, or None: its prompt leaves no room for a token in `max_context`, its request
        was aborted, its request or a sibling already holds or awaits state (`running` lanes included: a
        duplicate would take a second lane and lose the first's), or it needs more lanes than there are."""
        if ask.num_tokens >= max_context:
            return f"prompt of {ask.num_tokens} tokens leaves no room in a context of {max_context}"
        if ask.rid in self.gone:
            return "aborted"
        if any(rid in running or self.holds(rid) or self.asked(rid) for rid in [ask.rid, *ask.siblings]):
            return "a request with this id already holds state"
        if ask_lanes(ask) > self.max_running:
            return f"{ask_lanes(ask)} choices of one prompt need as many lanes; decode has {self.max_running}"
        return None

    @property
    def lanes(self) -> int:
        """Lanes the granted and reserved states take."""
        return len(self.granted) + len(self.reserved)

    def holds(self, rid: str) -> bool:
        """`rid` holds a granted or reserved state."""
        return rid in self.granted or rid in self.reserved

    def asked(self, rid: str) -> bool:
        """A waiting ask names `rid`, as its request or a sibling."""
        return any(a.rid == rid or rid in a.siblings for a in self.pending)

    def waiting(self, rid: str) -> bool:
        """`rid`'s ask waits for a lane or pages."""
        return any(a.rid == rid for a in self.pending)

    def fits(self, running: int) -> bool:
        """The first waiting ask has its lanes beside `running` lanes (its pages may still be missing)."""
        return bool(self.pending) and running + self.lanes + ask_lanes(self.pending[0]) <= self.max_running

    def grant_next(self) -> StateGranted | None:
        """Grant the first waiting ask its state and reserve its siblings' (those not aborted already), or
        None (and nothing taken) when the pool cannot give them all now."""
        ask = self.pending[0]
        siblings = [rid for rid in ask.siblings if rid not in self.gone]
        states = self._new_states(1 + len(siblings), ask.num_tokens)
        if states is None:
            return None
        self.pending.popleft()
        seq, *copies = states
        self.granted[ask.rid] = seq
        self.reserved.update({rid: (ask.rid, state) for rid, state in zip(siblings, copies, strict=True)})
        return StateGranted(ask.rid, seq.slot, list(seq.pages))

    def _new_states(self, count: int, num_tokens: int) -> list[SequenceState] | None:
        """`count` new states with pages for `num_tokens` each, or None (and nothing taken) when the pool
        cannot give them all now (a slot may still be retiring)."""
        states: list[SequenceState] = []
        try:
            for _ in range(count):
                states.append(self.pool.new_sequence())
                self.pool.reserve(states[-1], num_tokens)
        except PoolExhausted:
            for state in states:
                self.pool.release(state)
            return None
        return states

    def release_reserved(self, owner: str) -> None:
        """Free the reserved states of `owner`'s siblings that did not start (finished at their first
        token, or aborted)."""
        for rid in [rid for rid, (held_by, _) in self.reserved.items() if held_by == owner]:
            self.pool.release(self.reserved.pop(rid)[1])

    def forget(self, rid: str) -> SequenceState | None:
        """Drop `rid` wherever it waits or is held here: its ask, its reserved state and those of its
        siblings (freed now: prefill does not write them). Returns its granted state, for the caller to free
        once no launched step uses it."""
        self.aborted.discard(rid)
        kept = [a for a in self.pending if a.rid != rid]
        self.pending.clear()
        self.pending.extend(kept)
        for sibling in [s for s, (owner, _) in self.reserved.items() if rid in (s, owner)]:  # never started
            self.pool.release(self.reserved.pop(sibling)[1])
        return self.granted.pop(rid, None)


def ask_lanes(ask: AllocState) -> int:
    """Lanes an ask takes: its request's and its siblings'."""
    return 1 + len(ask.siblings)
