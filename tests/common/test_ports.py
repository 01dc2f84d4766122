"""Ports for services to bind: consecutive, free, below the kernel's range for outgoing connections, and a
taken one skipped."""

from __future__ import annotations

import socket

import pytest

from common import ports


def test_consecutive_free_ports_below_the_ephemeral_range() -> None:
    base = ports.free_ports(4)
    assert base >= ports.PORTS_FROM and base + 4 <= max(ports.ephemeral_low(), ports.PORTS_FROM + 1024)
    held = [socket.socket() for _ in range(4)]
    try:
        for offset, sock in enumerate(held):
            sock.bind(("127.0.0.1", base + offset))  # each is free: binds
    finally:
        for sock in held:
            sock.close()


def test_a_run_with_a_taken_port_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports.free_ports(1)))
        busy = taken.getsockname()[1]
        picks = iter([busy - 1, busy + 5])  # the first run of two holds the taken port
        monkeypatch.setattr(ports._RANDOM, "randrange", lambda *_: next(picks))
        assert ports.free_ports(2) == busy + 5
