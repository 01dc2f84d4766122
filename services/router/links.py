"""The router's connections to its workers' inboxes: what it sends them (`Generate`, `Encode`, `Abort`) and
the watch on each connection (a closed one tells that its worker exited)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import zmq
import zmq.asyncio

from common.ipc.transport import AsyncOutbox
from common.protocol import Abort, Encode, Generate
from services.router.config import RouterConfig
from services.router.pairs import Pair

log = logging.getLogger(__name__)

LinkHandler = Callable[[str, bool], None]
"""Called with a service's name and whether the router's connection to it is now open."""


class WorkerLinks:
    """One outbox to each worker of `pairs` (kept on the `Pair`) and, with `encoder`, one to the encoder;
    `open` connects them, `close` releases them. Aborts run as tasks of their own, outside the caller's
    cancellation."""

    def __init__(self, config: RouterConfig, pairs: list[Pair], encoder: bool, on_link: LinkHandler) -> None:
        self.config = config
        self.pairs = pairs
        self.encoder_box: AsyncOutbox | None = None
        """The connection to the encoder's inbox (`Encode`, `Abort`); None without one, or before `open`."""
        self._has_encoder = encoder
        self._on_link = on_link
        self._monitors: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ctx: zmq.asyncio.Context | None = None

    def open(self, ctx: zmq.asyncio.Context) -> None:
        """Connect to every worker's inbox and start watching the connections (inside the event loop)."""
        self._ctx = ctx
        for pair, addrs in zip(self.pairs, self.config.pairs, strict=True):
            self._connect(pair, addrs.prefill, addrs.decode)
        if self._has_encoder:
            keys = self.config.control_keys
            self.encoder_box = AsyncOutbox(self.config.encoder, ctx, True, keys, "encoder")
            self._watch("encoder", self.encoder_box)

    def move(self, pair: Pair, prefill: str, decode: str) -> None:
        """Connect to `pair`'s workers at their new inboxes (`PairMoved`), dropping the old connections."""
        for worker, box in ((pair.prefill, pair.prefill_box), (pair.decode, pair.decode_box)):
            monitor = self._monitors.pop(worker.name, None)
            if monitor is not None:
                monitor.cancel()
            if box is not None:
                box.close()
        self._connect(pair, prefill, decode)

    def _connect(self, pair: Pair, prefill: str, decode: str) -> None:
        assert self._ctx is not None, "open() first"
        keys = self.config.control_keys
        pair.prefill_box = AsyncOutbox(prefill, self._ctx, True, keys, pair.prefill.name)
        pair.decode_box = AsyncOutbox(decode, self._ctx, True, keys, pair.decode.name)
        self._watch(pair.prefill.name, pair.prefill_box)
        self._watch(pair.decode.name, pair.decode_box)

    async def send(self, pair: Pair, generate: Generate, encode: Encode | None) -> None:
        """Send a request to `pair`'s prefill worker, and first its images to the encoder (`encode`)."""
        assert pair.prefill_box is not None, "RouterCore.start() was not called"
        if encode is not None:
            assert self.encoder_box is not None
            await self.encoder_box.send(encode)
        await pair.prefill_box.send(generate)

    def abort(self, rid: str, pair: Pair, to_encoder: bool = False) -> None:
        """Abort `rid` at `pair`'s workers (and at the encoder with `to_encoder`), in the background."""
        self._spawn(self._send_abort(rid, pair, to_encoder))

    def abort_everywhere(self, rid: str) -> None:
        """Abort `rid` at every pair (which one runs it is not known)."""
        for pair in self.pairs:
            self.abort(rid, pair)

    async def stop_watching(self) -> None:
        """Stop the connection watches (before closing)."""
        for task in self._monitors.values():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def drain(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the aborts under way."""
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout_s)

    def close(self) -> None:
        boxes = [box for pair in self.pairs for box in (pair.prefill_box, pair.decode_box)]
        for box in (*boxes, self.encoder_box):
            if box is not None:
                box.close()

    def _watch(self, service: str, outbox: AsyncOutbox) -> None:
        self._monitors[service] = asyncio.create_task(
            self._watch_link(service, outbox), name=f"router-link-{service}"
        )

    async def _watch_link(self, service: str, outbox: AsyncOutbox) -> None:
        try:
            while True:
                self._on_link(service, await outbox.link_changed())
        except zmq.ZMQError:  # the context is going (close): nothing left to watch
            log.debug("%s: connection monitor ended", service, exc_info=True)

    async def _send_abort(self, rid: str, pair: Pair, to_encoder: bool) -> None:
        boxes = [pair.prefill_box, pair.decode_box, *([self.encoder_box] if to_encoder else [])]
        for outbox in boxes:
            if outbox is not None:
                try:
                    await outbox.send(Abort(rid))
                except zmq.ZMQError as exc:
                    log.warning("could not send Abort(%s) to %s: %s", rid, outbox.address, exc)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` as its own task (outside the caller's cancellation), keeping a reference to it."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
