"""Prefill and decode cores wired in one process (tests, benchmarks): each message goes to its core through
the wire encoding, as the worker loops pass them, and decode grants what waits after each message that
frees state, as its loop does."""

from __future__ import annotations

from collections.abc import Callable

from common.protocol import AllocState, PrefillDone, ReleaseState, StateGranted, Thaw, Tokens, decode, encode
from common.workers.decode import DecodeCore
from common.workers.prefill import Outgoing, PrefillCore


def deliver(
    dec: DecodeCore, pre: PrefillCore, box: Outgoing, to_router: Callable[[Tokens], None]
) -> Outgoing:
    """Hand each message of `box` to its core (the router's events to `to_router`); what they answer."""
    out: Outgoing = []
    for dest, sent in box:
        msg = decode(encode(sent))
        if dest == "router":
            to_router(msg)
        elif isinstance(msg, StateGranted):
            out += pre.granted(msg)
        elif isinstance(msg, AllocState):
            out += [("prefill", g) for g in dec.alloc_state(msg)]
        elif isinstance(msg, PrefillDone):
            dec.prefill_done(msg)
        elif isinstance(msg, ReleaseState):
            dec.release(msg.rid)
        elif isinstance(msg, Thaw):
            dec.set_freeze(msg.holder, False)
        if isinstance(msg, PrefillDone | ReleaseState | Thaw):
            out += [("prefill", g) for g in dec.grant_pending()]
    return out
