"""Synthetic qwen3_next (Qwen3-Next) checkpoints: transformers' own layout (config.json, keys, shapes, the
fused Gated DeltaNet projections), transformers loads them, and our logits match its in float32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.model.synthetic.checkpoint import make_model
from tests.common.model.synthetic.test_checkpoint import (
    _assert_clean_load,
    _checkpoint_tensors,
    _load_hf,
    _logits,
)
from tests.common.model.test_transformers_saved import PROMPTS

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("qwen3_next"), "tiny", "qwen3_next")


def test_config_is_what_transformers_writes(tiny: Path) -> None:
    """Field for field what Qwen3NextConfig's save_pretrained writes (its version aside; `torch_dtype`, as
    every synthetic config, for its `dtype`)."""
    cfg = json.loads((tiny / "config.json").read_text())
    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "torch_dtype")}
    written = transformers.Qwen3NextConfig(**fields).to_diff_dict()
    assert set(written) - set(cfg) == {"transformers_version"} and set(cfg) - set(written) == {"torch_dtype"}
    assert {k: v for k, v in written.items() if k in cfg} == {k: v for k, v in cfg.items() if k in written}
    assert cfg["torch_dtype"] == "bfloat16" and cfg["architectures"] == ["Qwen3NextForCausalLM"]
    assert "rope_theta" not in cfg and cfg["rope_parameters"]["partial_rotary_factor"] == 0.25
    gen = json.loads((tiny / "generation_config.json").read_text())
    assert gen == {"eos_token_id": [2, 0], "pad_token_id": 0, "bos_token_id": None}
    assert (tiny / "tokenizer.json").is_file() and "chat_template" in json.loads(
        (tiny / "tokenizer_config.json").read_text()
    )


def test_keys_and_shapes_are_save_pretrained_s(tiny: Path, tmp_path: Path) -> None:
    """The same keys and shapes as transformers' save_pretrained of a model of this config: the Gated
    DeltaNet's fused in_proj_qkvz / in_proj_ba, per-expert weights, a dense layer 1, no MTP head."""
    config = transformers.AutoConfig.from_pretrained(tiny)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    ours = {k: shape for k, (_, shape) in _checkpoint_tensors(tiny).items()}
    assert ours == {k: shape for k, (_, shape) in _checkpoint_tensors(tmp_path / "hf").items()}
    gdn, h = "model.layers.0.linear_attn", 64
    assert ours[f"{gdn}.in_proj_qkvz.weight"] == (2 * (16 + 16 + 2 * 16 + 2 * 16), h)  # 2 key heads
    assert ours[f"{gdn}.in_proj_ba.weight"] == (2 * 4, h)
    assert ours["model.layers.1.self_attn.q_proj.weight"] == (2 * 4 * 32, h)  # with the output gate
    assert ours["model.layers.1.mlp.up_proj.weight"] == (96, h)
    assert ours["model.layers.3.mlp.experts.7.down_proj.weight"] == (h, 32)
    assert len(list(tiny.glob("model-*-of-*.safetensors"))) >= 2


def test_loads_in_transformers(tiny: Path) -> None:
    model, info = _load_hf(tiny)
    _assert_clean_load(info)
    logits = _logits(model)
    assert logits.shape == (37, 1024) and torch.isfinite(logits).all()
    assert logits.std(dim=-1).min() > 0.5  # informative: wide spread, a clear top-1
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 0.05


@torch.inference_mode()
def test_logits_match_transformers(tiny: Path, matches_transformers) -> None:
    hf, _ = _load_hf(tiny)
    runner = Engine(WorkerConfig(str(tiny), max_running=2, max_context=64, dtype="float32")).runner
    seqs = [runner.new_sequence() for _ in PROMPTS]
    prefill = runner.forward(seqs, PROMPTS, all_logits=True)
    matches_transformers(runner, hf, seqs, PROMPTS, prefill, 8, 1e-4)


def test_what_make_model_does_not_write(tmp_path: Path) -> None:
    """The release-sized preset is planned only; no quantized variant (no layout for the fused ones)."""
    with pytest.raises(ValueError, match=r"qwen3-next-80b.*plan"):
        make_model(tmp_path / "big", "qwen3-next-80b")
    with pytest.raises(ValueError, match="qwen3_next unquantized only"):
        make_model(tmp_path / "fp8", "tiny", "qwen3_next", quantize="fp8")
    assert not (tmp_path / "big").exists() and not (tmp_path / "fp8").exists()
