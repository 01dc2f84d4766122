"""The shell both workers share: sockets, a stop flag set by SIGTERM/SIGINT, heartbeats."""

from __future__ import annotations

import logging
import os
import signal
import time

import torch

from common.protocol import Heartbeat, Message, Ready
from common.transport import Inbox, Outbox

HEARTBEAT_S = 1.0


class WorkerShell:
    """A worker's inbox, its outboxes by destination service, and its lifecycle."""

    def __init__(self, service: str, inbox: str, outboxes: dict[str, str], threads: int = 0) -> None:
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {service} %(levelname)s %(message)s")
        if threads:
            torch.set_num_threads(threads)
        self.service, self.pid = service, os.getpid()
        self.inbox = Inbox(inbox)
        self.out = {name: Outbox(address) for name, address in outboxes.items()}
        self.stopping = False
        self._last_beat = 0.0
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)

    def _stop(self, *_: object) -> None:
        self.stopping = True

    def send(self, dest: str, msg: Message) -> None:
        self.out[dest].send(msg)

    def receive(self, busy: bool) -> list[Message]:
        """Everything queued; when idle, wait up to 100 ms for the first message."""
        msgs = self.inbox.drain()
        if msgs or busy:
            return msgs
        first = self.inbox.recv(timeout_ms=100)
        return [first, *self.inbox.drain()] if first is not None else []

    def ready(self, capacity: int, metrics_url: str) -> None:
        self.send("router", Ready(self.service, self.pid, capacity, metrics_url))

    def heartbeat(self, running: int = 0, waiting: int = 0) -> None:
        now = time.monotonic()
        if now - self._last_beat >= HEARTBEAT_S:
            self._last_beat = now
            self.send("router", Heartbeat(self.service, self.pid, running, waiting))

    def close(self) -> None:
        self.inbox.close()
        for box in self.out.values():
            box.close()
