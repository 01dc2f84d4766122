"""Picking TCP ports for services (and tests) to bind a moment later.

A port the kernel hands out for a bind to port 0 comes from its ephemeral range, the range outgoing
connections take their source ports from: between the pick and the service's bind, a connection (this
process's, a worker's, Ray's) could take it and hold it for good. So ports are picked at random below that
range and checked free by binding them.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

PORTS_FROM = 20000
"""The lowest port picked (below it: well-known and registered services' usual ports)."""
TRIES = 100
_RANDOM = random.SystemRandom()  # not the global generator, which a test or a library may seed
_GIVEN: set[int] = set()


def free_ports(count: int = 1, host: str = "127.0.0.1", span: tuple[int, int] | None = None) -> int:
    """The first of `count` consecutive TCP ports free on `host` now, below the kernel's ephemeral range
    (anywhere from PORTS_FROM where that range starts too low to leave room), or within `span` (first, last:
    a firewall's opening) where given, none of them handed out before by this process (its callers bind
    them later, so a later pick must not reuse them)."""
    if count < 1:
        raise ValueError(f"count {count}: at least one port")
    low, top = (span[0], span[1] + 1) if span is not None else (PORTS_FROM, port_top())
    if top - count < low:
        raise RuntimeError(f"no room for {count} ports in [{low}, {top})")
    for _ in range(TRIES):
        base = _RANDOM.randrange(low, top - count + 1)
        run = range(base, base + count)
        if _GIVEN.intersection(run):
            continue
        try:
            with contextlib.ExitStack() as held:
                for port in run:
                    held.enter_context(socket.socket()).bind((host, port))
        except OSError:  # one taken: another run
            continue
        _GIVEN.update(run)
        return base
    raise RuntimeError(f"no {count} consecutive free TCP ports on {host} in [{low}, {top}) in {TRIES} tries")


def parse_port_range(text: str) -> tuple[int, int]:
    """ "30000-30999" → (30000, 30999); ValueError for anything else (ports 1 to 65535, first ≤ last)."""
    first, sep, last = text.partition("-")
    if not (sep and first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last) <= 65535):
        raise ValueError(f"{text!r} is not a port range FIRST-LAST (e.g. 30000-30999)")
    return int(first), int(last)


def check_free(host: str, port: int, what: str) -> None:
    """OSError naming `what` where `port` on `host` is taken (another server listens there): a service about
    to bind it would fail only after everything else had started."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no owner
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise OSError(f"{what}: {host}:{port} cannot be bound ({exc.strerror}): choose another") from None


def port_top() -> int:
    """The end of the range ports are picked from: the ephemeral range's start, or 65536 where that
    leaves less than 1024 ports above PORTS_FROM."""
    low = ephemeral_low()
    return low if low > PORTS_FROM + 1024 else 65536


def ephemeral_low() -> int:
    """The first port of the kernel's range for outgoing connections (Linux; else IANA's 49152)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152
