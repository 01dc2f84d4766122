"""The control plane's sockets with keys (CurveZMQ over tcp:// and ipc://): the known services talk, a
connection without the keys or with unknown ones gets nothing through (counted), and a message its sender's
role may not send is dropped and counted, as is a frame that does not decode."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import zmq

from common.ipc.keys import KEYS_ENV, ControlKeys, keys_env, make_keys
from common.ipc.ports import free_ports
from common.ipc.transport import AsyncInbox, Inbox, Outbox, ipc_address
from common.protocol import Heartbeat, ServiceDown, Tokens, may_send

NAMES = ["router", "prefill", "decode", "launcher"]


def _wait(inbox: Inbox, count: int, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while inbox.refused < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return inbox.refused


@pytest.fixture(params=["tcp", "ipc"])
def address(request, tmp_path: Path) -> str:
    return f"tcp://127.0.0.1:{free_ports(1)}" if request.param == "tcp" else ipc_address(tmp_path, "router")


def test_keyed_services_talk_and_each_message_comes_from_its_role(address: str) -> None:
    keys = make_keys(NAMES)
    inbox = Inbox(address, keys=keys["router"])
    boxes = {name: Outbox(address, keys=keys[name], peer="router") for name in ("decode", "launcher")}
    try:
        boxes["decode"].send(Heartbeat("decode", 7))
        assert inbox.recv(timeout_ms=5000) == Heartbeat("decode", 7)
        boxes["decode"].send(ServiceDown("decode", 7, -9))  # the launcher's to send
        boxes["decode"].send(Heartbeat("prefill", 8))  # speaks for another worker
        boxes["decode"].sock.send(b"\x00 not a message")
        assert [inbox.recv(timeout_ms=5000) for _ in range(3)] == [None] * 3
        boxes["launcher"].send(ServiceDown("decode", 7, -9))
        assert inbox.recv(timeout_ms=5000) == ServiceDown("decode", 7, -9)
        assert (inbox.rejected, inbox.dropped, inbox.refused) == (2, 1, 0)
    finally:
        for box in boxes.values():
            box.close()
        inbox.close()


def test_a_connection_without_the_keys_gets_nothing_through(address: str) -> None:
    keys = make_keys(NAMES)
    inbox = Inbox(address, keys=keys["router"])
    plain_ctx, stranger_ctx = zmq.Context(), zmq.Context()
    plain = Outbox(address, plain_ctx)
    public, secret = zmq.curve_keypair()  # a valid key pair, unknown to the router
    stranger_keys = ControlKeys(
        "launcher", secret, {"launcher": public, "router": keys["router"].public["router"]}
    )
    stranger = Outbox(address, stranger_ctx, keys=stranger_keys, peer="router")
    try:
        for _ in range(3):
            plain.send(ServiceDown("decode", 7, -9))
            stranger.send(ServiceDown("decode", 7, -9))
        assert inbox.recv(timeout_ms=1500) is None
        assert _wait(inbox, 2) >= 2, "both handshakes refused, and counted"
        assert inbox.drain() == []
    finally:
        plain.close()
        stranger.close()
        plain_ctx.destroy(0)
        stranger_ctx.destroy(0)
        inbox.close()


def test_the_async_inbox_names_each_sender(tmp_path: Path) -> None:
    keys = make_keys(NAMES)

    async def main() -> None:
        inbox = AsyncInbox(ipc_address(tmp_path, "router"), keys=keys["router"])
        box = Outbox(inbox.address, keys=keys["prefill"], peer="router")
        try:
            box.send(ServiceDown("decode", 7, -9))  # rejected: not the launcher
            box.send(Tokens("r", [1], index=0))
            assert await asyncio.wait_for(inbox.recv_from(), 10) == ("prefill", Tokens("r", [1], index=0))
            assert inbox.rejected == 1
        finally:
            box.close()
            inbox.close()

    asyncio.run(main())


def test_keys_travel_as_json_in_the_environment() -> None:
    keys = make_keys(NAMES)
    env = keys_env(keys["decode"])
    again = ControlKeys.from_env(env)
    assert again == keys["decode"] and KEYS_ENV in env
    assert keys["decode"].secret.decode() not in repr(again), "no secret in a repr (logs)"
    assert ControlKeys.from_env({}) is None
    assert not may_send(ServiceDown("decode", 1, 0), "decode-1") and may_send(
        Heartbeat("decode-1", 1), "decode-1"
    )
