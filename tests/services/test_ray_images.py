"""Images on Ray (`serve --ray local`): the encoder runs beside the router and sends the embeddings in its
messages (a pair's prefill may be on another machine, where the encoder's memory cannot be mapped); a chat
with two images answers what transformers answers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from common.model.synthetic.checkpoint import make_model
from tests.conftest import Server, free_port, free_ports, wait_status
from tests.services.test_serve_images import MAX_TOKENS, _chat, _data_url, _images, _reference

pytest.importorskip("ray")
pytestmark = pytest.mark.slow


def test_images_on_ray_answer_as_transformers(tmp_path) -> None:
    model = make_model(tmp_path / "q4v", "tiny", "qwen4_exp", {"torch_dtype": "float32"})
    port, metrics = free_port(), free_ports(1)
    argv = [sys.executable, "-m", "services.cli", "serve", "--ray", "local", "--model", str(model)]
    argv += ["--port", str(port), "--metrics-port", str(metrics), "--threads", "1", "--dtype", "float32"]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    server = Server(subprocess.Popen(argv, env=env), port)
    try:
        body = wait_status(server, "ok", timeout_s=300)
        assert "127.0.0.1" not in body["services"]["encoder"]["metrics_url"]  # on the node's address
        images, texts = _images(), ["Compare", " with", " and say which is brighter."]
        reply = server.client().chat.completions.create(
            model="q4v", messages=_chat(texts, [_data_url(i) for i in images]), max_tokens=MAX_TOKENS,
            temperature=0,
        )  # fmt: skip
        prompt_len, want = _reference(model, images, texts)
        assert reply.usage.prompt_tokens == prompt_len and reply.choices[0].message.content == want
    finally:
        assert server.stop() == 0
