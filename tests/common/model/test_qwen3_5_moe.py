"""qwen3_5_moe beyond test_transformers_saved's parity: the multimodal config and its text model alone parse
alike, as the release spells them (M-RoPE sections, every layer MoE), and the keys of the vision tower and
the MTP head are left out."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from common.model.hf_config import parse_architecture
from common.model.qwen3_5_moe import map_qwen3_5_moe_key
from common.model.qwen4_exp.config import Qwen4ExpConfig
from common.model.registry import ExpertKey

transformers = pytest.importorskip("transformers")

PATH = Path("config.json")
ROPE = {  # the release's
    "rope_type": "default",
    "rope_theta": 10_000_000,
    "partial_rotary_factor": 0.25,
    "mrope_section": [11, 11, 10],
    "mrope_interleaved": True,
}


def _parse(hf: dict) -> Qwen4ExpConfig:
    cfg = parse_architecture(hf, PATH)[1]
    assert isinstance(cfg, Qwen4ExpConfig)
    return cfg


def test_the_multimodal_config_and_its_text_model_parse_alike() -> None:
    """transformers' defaults (Qwen3.5-35B-A3B's shape) with the release's RoPE: 40 layers, every fourth
    full attention, all MoE with 256 experts, top-8 renormalised; M-RoPE read as plain RoPE (text only)."""
    whole = transformers.Qwen3_5MoeConfig(text_config={"rope_parameters": ROPE}).to_dict()
    whole["eos_token_id"] = 248046  # the release names it at the top level
    cfg = _parse(whole)
    assert cfg.model_type == "qwen3_5_moe" and cfg.num_layers == 40
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",) + cfg.layer_types[4:]
    assert cfg.layer_types.count("full_attention") == 10 and cfg.mlp_types == ("moe",) * 40
    assert (cfg.num_experts, cfg.top_k, cfg.norm_topk_prob) == (256, 8, True)
    assert (cfg.rope.theta, cfg.rope.partial_rotary_factor, cfg.rope.mrope_section) == (1e7, 0.25, ())
    assert not cfg.hyper_connections and cfg.eos_token_ids == (248046,)
    text = {**whole["text_config"], "eos_token_id": 248046}
    assert dataclasses.replace(_parse(text), model_type="qwen3_5_moe") == cfg


def test_the_vision_tower_and_mtp_head_are_left_out() -> None:
    cfg = _parse(transformers.Qwen3_5MoeConfig().to_dict())
    lm = "model.language_model.layers.3"
    assert map_qwen3_5_moe_key(f"{lm}.linear_attn.in_proj_qkv.weight", cfg) == (
        "model.layers.3.linear_attn.in_proj_qkv.weight"
    )
    assert map_qwen3_5_moe_key("model.layers.3.self_attn.q_norm.weight", cfg) == (
        "model.layers.3.self_attn.q_norm.weight"
    )
    assert map_qwen3_5_moe_key(f"{lm}.mlp.experts.gate_up_proj", cfg) == ExpertKey(3, None, "gate_up")
    assert map_qwen3_5_moe_key("lm_head.weight", cfg) == "lm_head.weight"
    for ignored in ("model.visual.blocks.0.attn.qkv.weight", "mtp.layers.0.mlp.gate.weight", "mtp.fc.weight"):
        assert map_qwen3_5_moe_key(ignored, cfg) is None
