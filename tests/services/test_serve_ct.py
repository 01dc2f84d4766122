"""`spillway serve` of llm-compressor's compressed-tensors W4A16 checkpoints (as `make-model --quantize w4a16`
writes them): the experts served from a host store of their published bits through a cache of half of them
(decode and prefill processes) answer a greedy chat as `spillway generate` does with every expert resident;
`spillway plan` counts the published bytes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from common.experts.formats import get_format
from common.model.synthetic.checkpoint import make_model

pytestmark = pytest.mark.slow

FORMATS = {"w4a16": "ct-w4a16-g32", "w4a16-asym": "ct-w4a16-asym-g32", "nvfp4a16": "ct-nvfp4a16"}
"""The expert format of each variant (the tiny preset's W4A16 groups are 32: its dims do not fit 128)."""


@pytest.mark.parametrize("quantize", ["w4a16"])
def test_greedy_chat_served_from_published_bits(quantize: str, start_server, tmp_path) -> None:
    model = make_model(tmp_path / f"tiny-{quantize}", preset="tiny", seed=2, quantize=quantize)
    server = start_server(
        "--model", str(model), "--threads", "1", "--max-running", "2", "--max-context", "512",
        "--expert-cache", "0.5", env={"SPILLWAY_CACHE": str(tmp_path / "cache")},
    )  # fmt: skip
    text = "Which experts are in four bits?"
    cli = [sys.executable, "-m", "services.cli", "generate", "--model", str(model), "--chat", text]
    ref = json.loads(
        subprocess.run(
            [*cli, "--max-tokens", "12", "--json"], capture_output=True, check=True, text=True
        ).stdout
    )
    reply = server.client().chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": text}], max_tokens=12, temperature=0
    )
    assert reply.choices[0].message.content == ref["text"]
    assert reply.usage.completion_tokens == len(ref["token_ids"]) == 12


@pytest.mark.parametrize("quantize", list(FORMATS))
def test_plan_counts_published_bytes(quantize: str, tmp_path) -> None:
    model = make_model(tmp_path / "m", preset="tiny", quantize=quantize)
    argv = [sys.executable, "-m", "services.cli", "plan", "--model", str(model), "--vram-budget", "2G"]
    out = subprocess.run([*argv, "--max-running", "2", "--json"], capture_output=True, check=True, text=True)
    plan = json.loads(out.stdout)
    assert plan["expert_format"] == FORMATS[quantize]
    assert plan["expert_bytes"] == get_format(FORMATS[quantize]).expert_nbytes(64, 32)
