"""The fd server: descriptors reach the asker in batches; a bad request or an unknown id ends that answer
with an error, and the server goes on serving."""

from __future__ import annotations

import os
import socket

import pytest

from common.ipc.fdpass import BATCH, FdServer, fetch_fds


@pytest.fixture
def server():
    files = {i: os.memfd_create(f"t{i}") for i in range(BATCH + 5)}
    for i, fd in files.items():
        os.write(fd, bytes([i % 256]))
    srv = FdServer(lambda i: os.dup(files[i]))
    yield srv
    srv.close()
    for fd in files.values():
        os.close(fd)


def _first_byte(fd: int) -> int:
    return os.pread(fd, 1, 0)[0]


def test_descriptors_arrive_in_batches(server) -> None:
    ids = list(range(BATCH + 5))
    batches = []
    for batch in fetch_fds(server.path, ids):
        batches.append(len(batch))
        for i, fd in batch.items():
            assert _first_byte(fd) == i % 256
            os.close(fd)
    assert batches == [BATCH, 5]


def test_bad_requests_end_their_answer_not_the_server(server) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.connect(server.path)
        sock.send(b"[" * 100_000)  # nested past the JSON decoder's recursion limit
        assert sock.recv(100) == b""  # closed
    with pytest.raises(OSError, match="source 10000"):
        for batch in fetch_fds(server.path, [1, 10_000]):
            for fd in batch.values():
                os.close(fd)
    (batch,) = fetch_fds(server.path, [3])
    assert _first_byte(batch[3]) == 3
    os.close(batch[3])
