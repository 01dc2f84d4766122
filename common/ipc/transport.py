"""Typed ZeroMQ sockets: an `Inbox` (PULL, bound) per service and `Outbox`es (PUSH, connected) to the others.

Frames are msgspec-encoded `common.protocol` messages. A frame that does not decode is dropped and counted
(`Inbox.dropped`), never raised: a bad peer cannot crash a worker. Addresses are `ipc://` paths in a private
run directory (mode 0700) by default, or `tcp://host:port`. Blocking (thread) and asyncio variants share the
encoding and the drop rule.

With `ControlKeys` (common/ipc/keys.py) every socket speaks CurveZMQ (ipc:// and tcp:// alike): an inbox
admits only connections whose client key is a known service's (a ZAP handler of its own, on a context of its
own; a refused handshake is counted in `Inbox.refused`), knows each message's sender by that key, and drops
(and counts in `Inbox.rejected`) a message its sender's role may not send (`common.protocol.may_send`).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from common.ipc.keys import ControlKeys
from common.protocol import Message, decode, encode, may_send

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


ZAP_DOMAIN = b"spillway"
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
LOGGED_REFUSALS = 10
"""Refused connections and rejected messages logged one by one; after that, every 1000th."""


class _Authenticator(ThreadAuthenticator):
    """The ZAP handler of a keyed inbox's context: admits the known services' client keys, each connection
    named (its messages' `User-Id`) by the service whose key it holds."""

    def __init__(self, ctx: zmq.Context, keys: ControlKeys) -> None:
        super().__init__(ctx, log=logging.getLogger(f"{__name__}.zap"))
        self.names = {z85.decode(key): name for name, key in keys.public.items()}

    def callback(self, domain: str, key: bytes) -> bool:
        """Whether the client key `key` (Z85) is a known service's (pyzmq's credentials provider)."""
        known = z85.decode(key) in self.names
        if not known:
            log.warning("refused a connection with an unknown key %s...", key[:8].decode(errors="replace"))
        return known

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.names[client_public_key]


class _Guard:
    """A keyed inbox's security: CurveZMQ server options on `sock` (before its bind), the ZAP handler, and a
    monitor that counts the handshakes that failed (no keys, unknown keys, garbage)."""

    def __init__(self, sock: zmq.Socket, ctx: zmq.Context, keys: ControlKeys) -> None:
        self.auth = _Authenticator(ctx, keys)
        self.auth.start()
        self.auth.configure_curve_callback(ZAP_DOMAIN.decode(), self.auth)
        sock.zap_domain = ZAP_DOMAIN
        sock.curve_server = True
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.own_public
        address = f"inproc://spillway-monitor-{id(sock)}"
        sock.monitor(address, HANDSHAKE_FAILED)
        self.monitor = ctx.socket(zmq.PAIR)
        self.monitor.connect(address)
        self.refused = 0

    def count(self) -> int:
        """Handshakes refused so far (the monitor's events read without waiting), each logged."""
        while self.monitor.poll(0):
            event = parse_monitor_message(self.monitor.recv_multipart())
            self.refused += 1
            if self.refused <= LOGGED_REFUSALS or self.refused % 1000 == 0:
                log.warning("refused a connection (%d so far): handshake failed (%s, errno %s)", self.refused,
                            event["endpoint"], event["value"])  # fmt: skip
        return self.refused

    def close(self) -> None:
        self.monitor.close(0)
        self.auth.stop()


def secure_client(sock: zmq.Socket, keys: ControlKeys | None, peer: str) -> None:
    """CurveZMQ client options on `sock` (before its connect) to the inbox of the service `peer`."""
    if keys is not None:
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.own_public
        sock.curve_serverkey = keys.server_key(peer)


class _Decoding:
    dropped = 0
    rejected = 0
    keys: ControlKeys | None = None
    _guard: _Guard | None = None

    def _decode(self, frame: bytes) -> Message | None:
        try:
            return decode(frame)
        except msgspec.DecodeError as exc:
            self.dropped += 1
            log.warning("dropped an undecodable frame (%d bytes): %s", len(frame), exc)
            return None

    def _take(self, frame: zmq.Frame) -> tuple[str | None, Message | None]:
        """`frame`'s sender (None without keys) and message: None where it does not decode, or where its
        sender may not send it (rejected and counted)."""
        sender = str(frame.get("User-Id")) if self.keys is not None else None
        msg = self._decode(frame.bytes)
        if msg is None or sender is None or may_send(msg, sender):
            return sender, msg
        self.rejected += 1
        if self.rejected <= LOGGED_REFUSALS or self.rejected % 1000 == 0:
            log.warning("rejected a %s from %s (%d so far): not a message it may send", type(msg).__name__,
                        sender, self.rejected)  # fmt: skip
        return sender, None

    @property
    def refused(self) -> int:
        """Connections refused (no keys or unknown ones: their frames never came through)."""
        return self._guard.count() if self._guard is not None else 0

    def _secure(self, sock: zmq.Socket, ctx: zmq.Context, keys: ControlKeys | None) -> None:
        self.keys = keys
        if keys is not None:
            self._guard = _Guard(sock, ctx, keys)

    def _close_guard(self) -> None:
        if self._guard is not None:
            self._guard.close()


class Inbox(_Decoding):
    """A bound PULL socket (blocking); with `keys`, on a context of its own (its ZAP handler's)."""

    def __init__(self, address: str, ctx: zmq.Context | None = None, keys: ControlKeys | None = None) -> None:
        self._own_ctx = zmq.Context() if keys is not None else None
        self.ctx = self._own_ctx or ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self._secure(self.sock, self.ctx, keys)
        self.sock.bind(address)
        self.address = address

    def recv(self, timeout_ms: int | None = None) -> Message | None:
        """The next message, or None after `timeout_ms` (or when the frame was dropped)."""
        if timeout_ms is not None and not self.sock.poll(timeout_ms):
            return None
        return self._take(self.sock.recv(copy=False))[1]

    def drain(self) -> list[Message]:
        """Every message already queued, without waiting."""
        out = []
        while self.sock.poll(0):
            msg = self._take(self.sock.recv(copy=False))[1]
            if msg is not None:
                out.append(msg)
        return out

    def close(self) -> None:
        self._close_guard()
        self.sock.close(0)
        if self._own_ctx is not None:
            self._own_ctx.term()


class Outbox:
    """A connected PUSH socket (blocking). Messages queue while the peer is down (up to the HWM)."""

    def __init__(
        self, address: str, ctx: zmq.Context | None = None, keys: ControlKeys | None = None, peer: str = ""
    ) -> None:
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        secure_client(self.sock, keys, peer)
        self.sock.connect(address)
        self.address = address
        self.keys, self.peer = keys, peer
        """With `keys`: CurveZMQ to the inbox of the service `peer`."""

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
    """A bound PULL socket for asyncio code; with `keys`, on a context of its own (its ZAP handler's)."""

    def __init__(
        self, address: str, ctx: zmq.asyncio.Context | None = None, keys: ControlKeys | None = None
    ) -> None:
        self._own_ctx = zmq.asyncio.Context() if keys is not None else None
        self.ctx = self._own_ctx or ctx or zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self._secure(self.sock, zmq.Context.shadow(self.ctx.underlying), keys)
        self.sock.bind(address)
        self.address = address

    async def recv(self) -> Message:
        """The next message that decodes (and that its sender may send)."""
        return (await self.recv_from())[1]

    async def recv_from(self) -> tuple[str | None, Message]:
        """The next message that decodes, and its sender's service name (None without keys)."""
        while True:
            sender, msg = self._take(await self.sock.recv(copy=False))
            if msg is not None:
                return sender, msg

    def close(self) -> None:
        self._close_guard()
        self.sock.close(0)
        if self._own_ctx is not None:
            self._own_ctx.term()


class AsyncOutbox:
    """A connected PUSH socket for asyncio code; with `monitor`, it also reports its connection's state."""

    def __init__(
        self,
        address: str,
        ctx: zmq.asyncio.Context | None = None,
        monitor: bool = False,
        keys: ControlKeys | None = None,
        peer: str = "",
    ) -> None:
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        secure_client(self.sock, keys, peer)
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
