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


def free_ports(count: int = 1, host: str = "127.0.0.1") -> int:
    """The first of `count` consecutive TCP ports free on `host` now, below the kernel's ephemeral range
    (anywhere from PORTS_FROM where that range starts too low to leave room)."""
    low = ephemeral_low()
    top = low if low > PORTS_FROM + 1024 else 65536
    for _ in range(TRIES):
        base = _RANDOM.randrange(PORTS_FROM, top - count + 1)
        try:
            with contextlib.ExitStack() as held:
                for port in range(base, base + count):
                    held.enter_context(socket.socket()).bind((host, port))
            return base
        except OSError:  # one taken: another run
            continue
    raise RuntimeError(
        f"no {count} consecutive free TCP ports on {host} in [{PORTS_FROM}, {top}) in {TRIES} tries"
    )


def ephemeral_low() -> int:
    """The first port of the kernel's range for outgoing connections (Linux; else IANA's 49152)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152
