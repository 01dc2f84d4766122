"""Spillway's runtime against HF transformers on the same synthetic checkpoints, in float32 on CPU.

For each family, hand-picked and random configs (shared expert, norm_topk_prob both ways, head_dim ≠
hidden/heads, tied embeddings, odd expert counts, rope scaling, sliding windows, glm4_moe's grouped sigmoid
router and partial RoPE): logits over a batch of
prompts of unequal lengths and 16 decode steps agree (relative error < 1e-4), and greedy generation gives the
same 32 tokens.
"""

from __future__ import annotations

import random

import pytest
import torch

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.engine.runner import ModelRunner
from common.model.synthetic.checkpoint import make_model
from common.protocol import SamplingParams

transformers = pytest.importorskip("transformers")

PROMPT_LENS = (5, 17, 11)
DECODE_STEPS = 16
REL_TOL = 1e-4


def _random_overrides(arch: str, seed: int) -> dict:
    rng = random.Random(seed)
    experts = rng.choice([3, 5, 7, 9])
    cfg: dict = {
        "num_experts_per_tok": rng.randint(1, min(3, experts)),
        "head_dim": rng.choice([16, 24, 40]),
        "num_key_value_heads": rng.choice([1, 2, 4]),
        "tie_word_embeddings": rng.random() < 0.5,
        "rope_theta": rng.choice([10000.0, 500000.0]),
    }
    if arch == "mixtral":
        cfg["num_local_experts"] = experts
    else:
        cfg["num_experts"] = experts
        cfg["norm_topk_prob"] = rng.random() < 0.5
        cfg["mlp_only_layers"] = rng.sample(range(4), rng.randint(0, 2))
    return cfg


CASES = [
    ("qwen3_moe", {}),
    (
        "qwen3_moe",
        {
            "num_experts": 7,
            "num_experts_per_tok": 3,
            "norm_topk_prob": False,
            "head_dim": 24,
            "tie_word_embeddings": True,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        },
    ),
    (
        "qwen3_moe",
        {
            "attention_bias": True,
            "decoder_sparse_step": 2,
            "num_key_value_heads": 4,
            "use_sliding_window": True,
            "sliding_window": 8,
        },
    ),
    ("qwen2_moe", {}),
    (
        "qwen2_moe",
        {
            "num_experts": 5,
            "norm_topk_prob": True,
            "tie_word_embeddings": True,
            "head_dim": 24,
            "mlp_only_layers": [0, 2],
            "rope_scaling": {"type": "linear", "factor": 2.0},
        },
    ),
    ("mixtral", {}),
    (
        "mixtral",
        {
            "num_local_experts": 5,
            "num_experts_per_tok": 3,
            "head_dim": 24,
            "tie_word_embeddings": True,
            "sliding_window": 8,
        },
    ),
    ("glm4_moe", {}),
    (
        "glm4_moe",
        {
            "n_group": 4,
            "topk_group": 2,
            "num_experts_per_tok": 3,
            "first_k_dense_replace": 2,
            "use_qk_norm": False,
            "attention_bias": False,
            "routed_scaling_factor": 2.5,
            "tie_word_embeddings": True,
        },
    ),
    *[
        (arch, _random_overrides(arch, seed))
        for arch in ("qwen3_moe", "qwen2_moe", "mixtral")
        for seed in (1, 2)
    ],
]


def _case_id(case: tuple[str, dict]) -> str:
    arch, overrides = case
    return arch + ("-" + "-".join(f"{k}={v}" for k, v in overrides.items()) if overrides else "-tiny")


@pytest.fixture(scope="module", params=CASES, ids=[_case_id(c)[:80] for c in CASES])
def checkpoint(request, tmp_path_factory):
    arch, overrides = request.param
    out = tmp_path_factory.mktemp(arch)
    make_model(out, preset="tiny", arch=arch, overrides=overrides, seed=len(out.name))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager"
    )
    return out, hf.eval()


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@torch.inference_mode()
def test_logits_match_transformers(checkpoint, matches_transformers):
    model_dir, hf = checkpoint
    engine = Engine(WorkerConfig(str(model_dir), max_running=4, max_context=64))
    runner: ModelRunner = engine.runner
    prompts = _prompts(engine.config.vocab_size)
    seqs = [runner.new_sequence() for _ in prompts]

    prefill = runner.forward(seqs, prompts, all_logits=True)  # [T, V], sequence by sequence
    matches_transformers(runner, hf, seqs, prompts, prefill, DECODE_STEPS, REL_TOL)


@torch.inference_mode()
def test_greedy_generation_matches_transformers(checkpoint):
    model_dir, hf = checkpoint
    engine = Engine(WorkerConfig(str(model_dir), max_running=2, max_context=64))
    prompts = _prompts(engine.config.vocab_size, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    ours = engine.generate(prompts, params)  # three prompts through two lanes: one waits for a free lane
    hf.generation_config.eos_token_id = None  # generate exactly 32 tokens, as ignore_eos does
    for prompt, result in zip(prompts, ours, strict=True):
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32, pad_token_id=0)
        assert result.token_ids == ref[0, len(prompt) :].tolist()
        assert result.finish_reason == "length"
