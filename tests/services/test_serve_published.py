"""`spillway serve` of checkpoints whose experts are published quantized (ModelOpt NVFP4, gpt-oss MXFP4,
GPTQModel, AutoAWQ, llm-compressor's compressed-tensors, as `make-model --quantize` writes them): the experts
served from a host store of their published bits through a cache of half of them (decode and prefill
processes) answer a greedy chat as `spillway generate` does with every expert resident; `spillway plan`
counts the published bytes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from common.experts.formats import get_format
from common.model.synthetic.checkpoint import make_model
from tests.common.model.published_checks import EXPERT_FORMAT

pytestmark = pytest.mark.slow


def _cli(*args: str) -> str:
    argv = [sys.executable, "-m", "services.cli", *args]
    return subprocess.run(argv, capture_output=True, check=True, text=True).stdout


SERVED = [
    *(("qwen3_moe", q) for q in EXPERT_FORMAT),
    *(("qwen4_exp", q) for q in ("nvfp4", "mxfp4", "gptq", "awq", "w4a16")),
]
"""Every variant for qwen3_moe; the five formats for qwen4_exp (its variants load and match transformers in
tests/common/model/test_qwen4_published.py)."""


@pytest.mark.parametrize(("arch", "quantize"), SERVED)
def test_greedy_chat_served_from_published_bits(arch: str, quantize: str, start_server, tmp_path) -> None:
    model = make_model(tmp_path / f"tiny-{quantize}", preset="tiny", arch=arch, seed=2, quantize=quantize)
    server = start_server(
        "--model", str(model), "--threads", "1", "--max-running", "2", "--max-context", "512",
        "--expert-cache", "0.5", env={"SPILLWAY_CACHE": str(tmp_path / "cache")},
    )  # fmt: skip
    text = "Which experts are in four bits?"
    ref = json.loads(_cli("generate", "--model", str(model), "--chat", text, "--max-tokens", "12", "--json"))
    reply = server.client().chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": text}], max_tokens=12, temperature=0
    )
    assert reply.choices[0].message.content == ref["text"]
    assert reply.usage.completion_tokens == len(ref["token_ids"]) == 12


@pytest.mark.parametrize("quantize", list(EXPERT_FORMAT))
def test_plan_counts_published_bytes(quantize: str, tmp_path) -> None:
    model = make_model(tmp_path / "m", preset="tiny", quantize=quantize)
    plan = json.loads(
        _cli("plan", "--model", str(model), "--vram-budget", "2G", "--max-running", "2", "--json")
    )
    assert plan["expert_format"] == EXPERT_FORMAT[quantize]
    assert plan["expert_bytes"] == get_format(EXPERT_FORMAT[quantize]).expert_nbytes(64, 32)


def test_make_model_cli_writes_desc_act(tmp_path) -> None:
    _cli("make-model", "--quantize", "gptq-desc-act", "--out", str(tmp_path / "m"))
    quant = json.loads((tmp_path / "m" / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "gptq" and quant["desc_act"] is True and quant["group_size"] == 32
