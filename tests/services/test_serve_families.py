"""`spillway serve` of the families beyond the first ones, experts offloaded through a cache of half: a
greedy chat through the openai client answers as `spillway generate` does in one process. glm4_moe: GLM-4.5's
grouped sigmoid router, shared experts, a dense first layer; qwen3_next: Gated DeltaNet and gated attention
layers, the fused input projections split on load, a dense layer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from common.model.synthetic.checkpoint import make_model

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("arch", "text"),
    [
        ("glm4_moe", "Which experts does the router pick?"),
        ("qwen3_next", "What does the delta rule remember?"),
    ],
)
def test_greedy_chat(start_server, tmp_path, arch: str, text: str) -> None:
    model = make_model(tmp_path / arch, preset="tiny", arch=arch, seed=3)
    server = start_server(
        "--model", str(model), "--threads", "1", "--max-running", "2", "--max-context", "512",
        "--expert-cache", "0.5", env={"SPILLWAY_CACHE": str(tmp_path / "cache")},
    )  # fmt: skip
    argv = [sys.executable, "-m", "services.cli", "generate", "--model", str(model), "--chat", text]
    ref = json.loads(
        subprocess.run([*argv, "--max-tokens", "12", "--json"], capture_output=True, check=True).stdout
    )
    reply = server.client().chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": text}], max_tokens=12, temperature=0
    )
    assert reply.choices[0].message.content == ref["text"]
    assert reply.usage.completion_tokens == len(ref["token_ids"]) == 12
