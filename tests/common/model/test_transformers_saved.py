"""Checkpoints written by transformers itself (`save_pretrained` of a randomly initialised model: its own
config.json spellings — `num_local_experts`, `rope_parameters`, `layer_types`, `dtype` — and its own weight
layout) load, and their logits over prefill and decode match transformers' in float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.model.synthetic.tokenizer import write_tokenizer

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
}
PROMPTS = [[5, 17, 99, 3, 42, 7, 7, 300, 12, 9, 4], [8, 9, 10]]


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(request.param, **SMALL, **FAMILIES[request.param])
    config._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in hf.parameters():  # wider than the init's 0.02: logits far apart, routing decisive
            p.normal_(0.0, 0.1 if p.dim() > 1 else 1.0)
    out = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(out)
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
    experts = getattr(hf.config, "num_experts", None) or hf.config.num_local_experts
    assert (cfg.num_experts, cfg.top_k, cfg.num_layers) == (experts, 2, 3)
    assert cfg.rope.theta == hf.config.rope_parameters["rope_theta"]
