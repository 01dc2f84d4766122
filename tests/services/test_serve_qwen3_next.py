"""`spillway serve` of make-model's qwen3_next checkpoint (Gated DeltaNet and gated attention layers, the
fused input projections split on load, a dense layer), experts offloaded through a cache of half: a greedy
chat through the openai client answers as `spillway generate` does in one process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from common.model.synthetic.checkpoint import make_model

pytestmark = pytest.mark.slow


def test_greedy_chat(start_server, tmp_path) -> None:
    model = make_model(tmp_path / "qwen3-next", preset="tiny", arch="qwen3_next", seed=3)
    server = start_server(
        "--model", str(model), "--threads", "1", "--max-running", "2", "--max-context", "512",
        "--expert-cache", "0.5", env={"SPILLWAY_CACHE": str(tmp_path / "cache")},
    )  # fmt: skip
    text = "What does the delta rule remember?"
    argv = [sys.executable, "-m", "services.cli", "generate", "--model", str(model), "--chat", text]
    ref = json.loads(
        subprocess.run([*argv, "--max-tokens", "12", "--json"], capture_output=True, check=True).stdout
    )
    reply = server.client().chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": text}], max_tokens=12, temperature=0
    )
    assert reply.choices[0].message.content == ref["text"]
    assert reply.usage.completion_tokens == len(ref["token_ids"]) == 12
