"""File descriptors from one process to another over a Unix socket (SCM_RIGHTS): how AliasedMemory's physical
allocations (memfds on the host, the driver's POSIX-fd handles on CUDA) reach an importer
(common/ipc/aliased.py).

The exporter serves a SOCK_SEQPACKET socket in a fresh private directory (mode 0700: only its user can
connect). A request is a JSON array of source ids; the answer is one packet per batch of at most `BATCH`
descriptors, each packet a JSON array of the ids it carries with their descriptors attached. Nothing but JSON
integers is ever decoded. An id the exporter cannot give ends the answer with {"error": ...}. Both sides time
out rather than wait for a peer that stopped answering.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence

BATCH = 200
"""Descriptors a packet carries (the kernel takes at most 253); an importer holds one batch at a time."""
TIMEOUT_S = 60.0
_MAX_REQUEST = 1 << 20


class FdServer:
    """Serves `open_fd(source id) → fd` (a descriptor the server closes once sent) on a private socket."""

    def __init__(self, open_fd: Callable[[int], int]) -> None:
        self.open_fd = open_fd
        self._dir = tempfile.mkdtemp(prefix="spillway-fds-")
        self.path = os.path.join(self._dir, "sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.bind(self.path)
        self._sock.listen(16)
        atexit.register(self.close)
        threading.Thread(target=self._serve, name="fd-server", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            with conn, contextlib.suppress(Exception):  # one bad request ends its connection, not the server
                conn.settimeout(TIMEOUT_S)
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        ids = json.loads(conn.recv(_MAX_REQUEST))
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise ValueError("a request is a JSON array of source ids")
        for start in range(0, len(ids), BATCH):
            batch, fds = ids[start : start + BATCH], []
            try:
                for i in batch:
                    fds.append(self.open_fd(i))
                socket.send_fds(conn, [json.dumps(batch).encode()], fds)
            except Exception as exc:
                conn.send(json.dumps({"error": f"source {i}: {exc!r}"}).encode())
                return
            finally:
                for fd in fds:
                    os.close(fd)

    def close(self) -> None:
        self._sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def fetch_fds(path: str, ids: Sequence[int]) -> Iterator[dict[int, int]]:
    """The descriptors of `ids` from the FdServer at `path`, a batch at a time ({id: fd}); the caller closes
    each batch's before it asks for the next."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(TIMEOUT_S)
        sock.connect(path)
        sock.send(json.dumps(list(ids)).encode())
        left = len(ids)
        while left:
            data, fds, _, _ = socket.recv_fds(sock, _MAX_REQUEST, BATCH)
            got = json.loads(data) if data else {"error": "the exporter closed the connection"}
            if isinstance(got, dict) or len(got) != len(fds) or not fds:
                for fd in fds:
                    os.close(fd)
                raise OSError(f"fd server {path}: {got.get('error') if isinstance(got, dict) else got}")
            left -= len(fds)
            yield dict(zip(got, fds, strict=True))
