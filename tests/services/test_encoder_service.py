"""`python -m services.encoder` as a real process over real ZeroMQ sockets: it says Ready to the router,
encodes a request's images into its shared buffer and tells the request's prefill worker where, gives the rows
back on ImagesTaken, and stops on SIGTERM; a text-only model stops it at start, saying why."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from common import ipc
from common.image_encoder import ImageEncoder
from common.images import decode_image
from common.model.synthetic import make_model
from common.protocol import Encode, Heartbeat, ImagesEncoded, ImagesTaken, Ready
from common.transport import Inbox, Outbox, ipc_address
from services.encoder.main import CAPACITY

Image = pytest.importorskip("PIL.Image")


def png(h: int, w: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def start(model: Path, run: Path, *flags: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "services.encoder", "--model", str(model), "--threads", "1"]
    argv += ["--inbox", ipc_address(run, "encoder"), "--router", ipc_address(run, "router")]
    argv += ["--prefill", f"prefill={ipc_address(run, 'prefill')}", *flags]
    return subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)


def receive(inbox: Inbox, kind: type, timeout_s: float = 60.0):
    """The next message of type `kind` (heartbeats and the like before it are skipped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        msg = inbox.recv(timeout_ms=200)
        if isinstance(msg, kind):
            return msg
    raise AssertionError(f"no {kind.__name__} in {timeout_s} s")


def test_the_encoder_process_lends_the_images_rows_to_prefill(tmp_path: Path) -> None:
    model = make_model(tmp_path / "q4", "tiny", "qwen4_exp", {"torch_dtype": "float32"})
    router, prefill = Inbox(ipc_address(tmp_path, "router")), Inbox(ipc_address(tmp_path, "prefill"))
    to_encoder = Outbox(ipc_address(tmp_path, "encoder"))
    proc = start(model, tmp_path, "--rows", "100")
    try:
        ready = receive(router, Ready)
        assert (ready.service, ready.pid, ready.capacity) == ("encoder", proc.pid, CAPACITY)
        images = [png(50, 90, 1), png(64, 64, 2)]
        to_encoder.send(Encode("r1", images, "prefill"))
        msg = receive(prefill, ImagesEncoded)
        assert (msg.rid, msg.start, msg.rows, msg.grids, msg.error) == (
            "r1",
            0,
            10,
            [[1, 4, 6], [1, 4, 4]],
            "",
        )
        want = ImageEncoder(model).encode([decode_image(raw) for raw in images])
        rows = ipc.import_tensor(msg.buffer)  # [100, H]: the encoder's buffer, mapped
        assert rows.shape == (100, 64)
        # (float32 tolerances: the process runs one thread, this one more)
        torch.testing.assert_close(rows[0:10], torch.cat([e.embeddings for e in want]))

        to_encoder.send(Encode("r2", [b"\x89PNG broken"], "prefill"))
        bad = receive(prefill, ImagesEncoded)
        assert bad.rid == "r2" and bad.buffer is None and "cannot be read" in bad.error

        assert receive(router, Heartbeat, timeout_s=5).service == "encoder"
        to_encoder.send(ImagesTaken("r1"))  # (one socket: the encoder reads it before r3)
        to_encoder.send(Encode("r3", [png(64, 64, 3)], "prefill"))
        assert (receive(prefill, ImagesEncoded).start, proc.poll()) == (0, None), "r1's rows, reused"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for sock in (router, prefill, to_encoder):
            sock.close()


def test_a_text_only_model_stops_the_encoder_at_start(tmp_path: Path) -> None:
    model = make_model(tmp_path / "text", "tiny", "qwen3_moe")
    proc = start(model, tmp_path)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "has no vision_config" in err, err
    proc = start(model, tmp_path, "--if-vision")  # a deployment that starts it whatever the model
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err


def test_the_encoder_needs_somewhere_to_send_its_rows(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "services.encoder", "--model", str(tmp_path), "--inbox", "ipc://x"]
    run = subprocess.run([*argv, "--router", "ipc://y"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "at least one --prefill" in run.stderr
