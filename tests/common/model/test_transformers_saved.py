"""Checkpoints written by transformers itself (qwen3_moe, qwen2_moe, mixtral, glm4_moe: its grouped sigmoid
router with a correction bias, shared experts, partial RoPE, q/k norms, a dense first layer; qwen3_next: Gated
DeltaNet and gated attention layers, (1 + w) norms, its interleaved projections; qwen3_5_moe: the same model
with unfused projections and M-RoPE, saved text-only and as the multimodal model, its text model nested beside
a vision tower that is not loaded), each the `save_pretrained` of a randomly initialised model: its own
config.json spellings — `num_local_experts`, `rope_parameters`, `layer_types`, `dtype` — and its own weight
layout) load, and their logits over prefill and decode match transformers' in float32."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.model.synthetic.tokenizer import write_tokenizer
from common.protocol import SamplingParams

transformers = pytest.importorskip("transformers")

SMALL = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "max_position_embeddings": 256,
}
FAMILIES = {
    "qwen3_moe": {
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "mlp_only_layers": [1],
    },
    "qwen2_moe": {
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
    },
    "mixtral": {"num_local_experts": 5, "num_experts_per_tok": 2, "sliding_window": 8},
    "glm4_moe": {
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 2,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "use_qk_norm": True,
        "attention_bias": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    },
    "qwen3_next": {  # Gated DeltaNet, gated attention, a dense layer; each key head serves 2 value heads
        "layer_types": ["linear_attention", "full_attention", "linear_attention"],
        "mlp_only_layers": [2],
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 8,
    },
}
QWEN3_5_TEXT = {  # every layer MoE; M-RoPE sections over the 3 frequencies of 6 rotary dims, interleaved
    **{k: v for k, v in FAMILIES["qwen3_next"].items() if k != "mlp_only_layers"},
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 1],
        "mrope_interleaved": True,
    },
}
FAMILIES["qwen3_5_moe_text"] = QWEN3_5_TEXT  # transformers' Qwen3_5MoeForCausalLM, flat keys
FAMILIES["qwen3_5_moe"] = QWEN3_5_TEXT  # the multimodal model: text_config, model.language_model.*
VISION = {  # multimodal families: a vision tower, saved and not loaded
    "qwen3_5_moe": {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_heads": 2,
        "out_hidden_size": 64,
        "num_position_embeddings": 16,
        "patch_size": 4,
    }
}
MULTIMODAL = {"qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
PROMPTS = [[5, 17, 99, 3, 42, 7, 7, 300, 12, 9, 4], [8, 9, 10]]


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    name = request.param
    if name in MULTIMODAL:
        text = {**SMALL, **FAMILIES[name]}
        text.pop("intermediate_size")  # the text config has no dense MLP
        config = transformers.AutoConfig.for_model(name, text_config=text, vision_config=VISION[name])
        config._attn_implementation = "eager"
        hf = getattr(transformers, MULTIMODAL[name])(config).eval()
    else:
        config = transformers.AutoConfig.for_model(name, **SMALL, **FAMILIES[name])
        config._attn_implementation = "eager"
        hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in hf.parameters():  # wider than the init's 0.02: logits far apart, routing decisive
            p.normal_(0.0, 0.1 if p.dim() > 1 else 1.0)
        for name, b in hf.named_buffers():  # GLM's router correction: the choice no longer the weights' top
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    out = tmp_path_factory.mktemp(request.param)
    with torch.no_grad():  # bf16 values, as releases are (a host store of bf16 experts is then exact)
        for p in hf.parameters():
            p.copy_(p.bfloat16())
    copy.deepcopy(hf).to(torch.bfloat16).save_pretrained(out)  # (hf's own buffers stay fp32)
    write_tokenizer(out, vocab_size=SMALL["vocab_size"], vision=False)
    return out, hf


@torch.inference_mode()
def test_logits_match_transformers(saved, matches_transformers) -> None:
    model_dir, hf = saved
    engine = Engine(WorkerConfig(str(model_dir), max_running=2, max_context=64, dtype="float32"))
    runner = engine.runner
    seqs = [runner.new_sequence() for _ in PROMPTS]
    prefill = runner.forward(seqs, PROMPTS, all_logits=True)
    matches_transformers(runner, hf, seqs, PROMPTS, prefill, 8, 1e-4)


def test_the_config_is_read_as_transformers_wrote_it(saved) -> None:
    model_dir, hf = saved
    cfg = Engine(WorkerConfig(str(model_dir), max_running=1, max_context=64)).config
    text = hf.config.get_text_config()
    experts = getattr(text, "num_experts", None) or text.num_local_experts
    assert (cfg.num_experts, cfg.top_k, cfg.num_layers) == (experts, 2, 3)
    assert cfg.rope.theta == text.rope_parameters["rope_theta"]


def test_offloaded_experts_generate_as_resident(saved) -> None:
    """The experts from a host store through a cache of half of them: the same greedy tokens."""
    model_dir, _ = saved
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runs = [
        Engine(WorkerConfig(str(model_dir), max_running=2, max_context=64, expert_cache=cache)).generate(
            PROMPTS, params
        )
        for cache in (None, "0.5")
    ]
    assert [r.token_ids for r in runs[0]] == [r.token_ids for r in runs[1]]
