"""Typed ZeroMQ sockets: an `Inbox` (PULL, bound) per service and `Outbox`es (PUSH, connected) to the others.

Frames are msgspec-encoded `common.protocol` messages. A frame that does not decode is dropped and counted
(`Inbox.dropped`), never raised: a bad peer cannot crash a worker. Addresses are `ipc://` paths in a private
run directory (mode 0700) by default, or `tcp://host:port`. Blocking (thread) and asyncio variants share the
encoding and the drop rule.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from common.protocol import Message, decode, encode

log = logging.getLogger(__name__)

SERVICES = ("router", "encoder", "prefill", "decode")


def make_run_dir(parent: str | Path | None = None) -> Path:
    """A fresh private directory (0700) for ipc:// sockets."""
    path = Path(tempfile.mkdtemp(prefix="spillway-", dir=parent))
    os.chmod(path, 0o700)
    return path


def ipc_address(run_dir: str | Path, service: str) -> str:
    return f"ipc://{Path(run_dir) / service}.sock"


def pair_names(pair: int) -> tuple[str, str]:
    """The service names of the prefill and decode workers of pair `pair` (the router serves several pairs):
    `prefill` and `decode` for the first, `prefill-N` and `decode-N` for the others."""
    suffix = f"-{pair}" if pair else ""
    return f"prefill{suffix}", f"decode{suffix}"


class _Decoding:
    dropped = 0

    def _decode(self, frame: bytes) -> Message | None:
        try:
            return decode(frame)
        except msgspec.DecodeError as exc:
            self.dropped += 1
            log.warning("dropped an undecodable frame (%d bytes): %s", len(frame), exc)
            return None


class Inbox(_Decoding):
    """A bound PULL socket (blocking)."""

    def __init__(self, address: str, ctx: zmq.Context | None = None) -> None:
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.address = address

    def recv(self, timeout_ms: int | None = None) -> Message | None:
        """The next message, or None after `timeout_ms` (or when the frame was dropped)."""
        if timeout_ms is not None and not self.sock.poll(timeout_ms):
            return None
        return self._decode(self.sock.recv())

    def drain(self) -> list[Message]:
        """Every message already queued, without waiting."""
        out = []
        while self.sock.poll(0):
            msg = self._decode(self.sock.recv())
            if msg is not None:
                out.append(msg)
        return out

    def close(self) -> None:
        self.sock.close(0)


class Outbox:
    """A connected PUSH socket (blocking). Messages queue while the peer is down (up to the HWM)."""

    def __init__(self, address: str, ctx: zmq.Context | None = None) -> None:
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.address = address

    def send(self, msg: Message) -> None:
        self.sock.send(encode(msg))

    def try_send(self, msg: Message) -> bool:
        """Send without waiting: False (`msg` dropped) when the HWM's worth already waits for a peer that
        does not read."""
        try:
            self.sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        self.sock.close(0)


class AsyncInbox(_Decoding):
    """A bound PULL socket for asyncio code."""

    def __init__(self, address: str, ctx: zmq.asyncio.Context | None = None) -> None:
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.address = address

    async def recv(self) -> Message:
        """The next message that decodes."""
        while True:
            msg = self._decode(await self.sock.recv())
            if msg is not None:
                return msg

    def close(self) -> None:
        self.sock.close(0)


class AsyncOutbox:
    """A connected PUSH socket for asyncio code; with `monitor`, it also reports its connection's state."""

    def __init__(self, address: str, ctx: zmq.asyncio.Context | None = None, monitor: bool = False) -> None:
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        events = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
        self._monitor = self.sock.get_monitor_socket(events) if monitor else None
        self.sock.connect(address)
        self.address = address

    async def send(self, msg: Message) -> None:
        await self.sock.send(encode(msg))

    async def link_changed(self) -> bool:
        """Wait for the connection to the bound peer to open (True) or close (False): a peer process's exit
        closes it at once (ipc:// and tcp:// alike); ZeroMQ reconnects to its successor by itself."""
        assert self._monitor is not None, "AsyncOutbox(monitor=True) reports its connection"
        event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
        return event == zmq.EVENT_CONNECTED

    def close(self) -> None:
        if self._monitor is not None:
            self.sock.disable_monitor()
            self._monitor.close(0)
        self.sock.close(0)
