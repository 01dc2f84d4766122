"""`python -m services.encoder` as a real process over real ZeroMQ sockets: it says Ready to the router,
encodes a request's images into its shared buffer and tells the request's prefill worker where, gives the rows
back on ImagesTaken, counts all of it on its metrics port (every encoder metric the dashboard reads), and
stops on SIGTERM; a text-only model stops it at start, saying why."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from common.ipc import tensors as ipc
from common.ipc.transport import Inbox, Outbox, ipc_address
from common.model.synthetic.checkpoint import make_model
from common.protocol import Encode, Heartbeat, ImagesEncoded, ImagesTaken, Ready
from common.vision.encoder import ImageEncoder
from common.vision.images import decode_image
from services.encoder.main import CAPACITY
from tests.conftest import free_port
from tests.deploy.deployment import ENCODER, queries, selectors

Samples = dict[tuple[str, frozenset], float]
"""(sample name, its labels) → value, as one scrape of a metrics port gives them."""

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


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scraped(url: str, until: Callable[[Samples], bool], timeout_s: float = 20.0) -> Samples:
    """The first scrape that satisfies `until` (the counters move with the encoder's next heartbeat)."""
    deadline = time.monotonic() + timeout_s
    while not until(samples := scrape(url)):
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} never got there: {samples}")
        time.sleep(0.1)
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((f"spillway:{name}", frozenset(labels.items())), 0.0)


def test_the_encoder_process_lends_the_images_rows_to_prefill(tmp_path: Path) -> None:
    model = make_model(tmp_path / "q4", "tiny", "qwen4_exp", {"torch_dtype": "float32"})
    router, prefill = Inbox(ipc_address(tmp_path, "router")), Inbox(ipc_address(tmp_path, "prefill"))
    to_encoder = Outbox(ipc_address(tmp_path, "encoder"))
    port = free_port()
    metrics_url = f"http://127.0.0.1:{port}/metrics"
    proc = start(model, tmp_path, "--rows", "100", "--metrics-port", str(port))
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
        counted = scraped(metrics_url, lambda s: value(s, "images_encoded_total") > 0)
        assert (value(counted, "images_encoded_total"), value(counted, "image_tokens_total")) == (2, 10)
        assert (
            value(counted, "image_encode_seconds_count") == 1
            and value(counted, "image_encode_seconds_sum") > 0
        )
        assert (value(counted, "encoder_rows_lent"), value(counted, "encoder_rows_capacity")) == (10, 100)
        dashboard = {name for expr in queries() for name, job in selectors(expr) if job == ENCODER}
        assert dashboard <= {name for name, _ in counted} | {"up"}, "every encoder series the dashboard reads"

        to_encoder.send(Encode("r2", [b"\x89PNG broken"], "prefill"))
        bad = receive(prefill, ImagesEncoded)
        assert bad.rid == "r2" and bad.buffer is None and "cannot be read" in bad.error

        assert receive(router, Heartbeat, timeout_s=5).service == "encoder"
        to_encoder.send(ImagesTaken("r1"))  # (one socket: the encoder reads it before r3)
        to_encoder.send(Encode("r3", [png(64, 64, 3)], "prefill"))
        assert (receive(prefill, ImagesEncoded).start, proc.poll()) == (0, None), "r1's rows, reused"
        to_encoder.send(ImagesTaken("r3"))
        counted = scraped(
            metrics_url,
            lambda s: value(s, "image_encode_seconds_count") == 2 and value(s, "encoder_rows_lent") == 0,
        )
        assert (value(counted, "images_encoded_total"), value(counted, "image_tokens_total")) == (3, 14)
        refused = {
            r: value(counted, "image_requests_refused_total", reason=r) for r in ("decode", "too_large")
        }
        assert refused == {"decode": 1, "too_large": 0}
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
