"""Ports for services to bind: consecutive, free, below the kernel's range for outgoing connections, a taken
one skipped and none handed out twice."""

from __future__ import annotations

import socket

import pytest

from common.ipc import ports


def test_consecutive_free_ports_below_the_ephemeral_range() -> None:
    base = ports.free_ports(4)
    assert base >= ports.PORTS_FROM and base + 4 <= ports.port_top()
    assert ports.free_ports(1) not in range(base, base + 4)  # handed out once
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
        ports._GIVEN.discard(busy)  # as if another process had taken it
        before = busy - 10
        ports._GIVEN.add(before)
        picks = iter([busy - 1, before, busy - 20])  # holds the taken port; handed out before; free
        monkeypatch.setattr(ports._RANDOM, "randrange", lambda *_: next(picks))
        assert ports.free_ports(2) == busy - 20


def test_a_port_another_server_listens_on_is_named_as_taken() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", ports.free_ports(1)))
        server.listen()
        port = server.getsockname()[1]
        with pytest.raises(OSError, match=rf"--port: 127.0.0.1:{port} cannot be bound .*choose another"):
            ports.check_free("127.0.0.1", port, "--port")
    ports.check_free("127.0.0.1", port, "--port")  # closed: free again


def test_ports_within_a_range_and_its_spelling() -> None:
    first = ports.port_top() - 1000
    picked = {ports.free_ports(1, span=(first, first + 999)) for _ in range(3)}
    assert len(picked) == 3 and all(first <= p <= first + 999 for p in picked)
    assert ports.parse_port_range("30000-30999") == (30000, 30999)
    for bad in ("30000", "2-1", "0-5", "1-70000", "a-b"):
        with pytest.raises(ValueError, match="not a port range"):
            ports.parse_port_range(bad)
