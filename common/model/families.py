"""The HF families that share MoECausalLM: qwen3_moe, qwen2_moe, mixtral, glm4_moe.

Each family contributes a config parser (HF config.json → ModelConfig, with HF's own defaults) and a
checkpoint key mapper (per-expert keys as the released checkpoints name them, and the fused
`experts.gate_up_proj` / `experts.down_proj` keys transformers 5 writes).
"""

from __future__ import annotations

import re
from typing import Any

from common.config import ModelConfig
from common.model.moe_lm import MoECausalLM
from common.model.registry import Architecture, ExpertKey, register_architecture
from common.model.rope_config import parse_rope

_PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj$")
_MIXTRAL_PARTS = {"w1": "gate", "w3": "up", "w2": "down"}


def qwen_expert_key(key: str, cfg: ModelConfig | None = None) -> str | ExpertKey:
    """Per-expert or fused routed-expert keys → ExpertKey; anything else unchanged."""
    if m := _PER_EXPERT.match(key):
        return ExpertKey(int(m[1]), int(m[2]), m[3])
    if m := _FUSED.match(key):
        return ExpertKey(int(m[1]), None, m[2])
    return key


def _mixtral_key(key: str, cfg: ModelConfig | None = None) -> str | ExpertKey:
    key = key.replace(".block_sparse_moe.", ".mlp.")
    m = re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(w[123])\.weight$", key)
    if m:
        return ExpertKey(int(m[1]), int(m[2]), _MIXTRAL_PARTS[m[3]])
    return qwen_expert_key(key)


def common_fields(hf: dict[str, Any], default_eps: float) -> dict[str, Any]:
    """The ModelConfig fields every flat Qwen-style config.json spells alike (norm epsilon: `default_eps`
    where it names none)."""
    heads = hf["num_attention_heads"]
    eos = hf.get("eos_token_id")
    return dict(
        model_type=hf["model_type"],
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=hf.get("rms_norm_eps", default_eps),
        max_position=hf.get("max_position_embeddings", 32768),
        rope=parse_rope(hf),
        hidden_act=hf.get("hidden_act", "silu"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"),
    )


def qwen_experts(hf: dict[str, Any], default: int) -> int:
    """`num_experts`, or `num_local_experts` as transformers 5 saves a Qwen MoE config (llm-compressor's
    checkpoints, for one)."""
    return hf.get("num_experts", hf.get("num_local_experts", default))


def qwen_mlp_types(hf: dict[str, Any], experts: int) -> tuple[str, ...]:
    """HF's rule, for `experts` routed experts a layer: MoE unless listed in mlp_only_layers, or off the
    decoder_sparse_step grid."""
    only = set(hf.get("mlp_only_layers") or [])
    step = hf.get("decoder_sparse_step", 1)
    return tuple(
        "moe" if i not in only and experts > 0 and (i + 1) % step == 0 else "dense"
        for i in range(hf["num_hidden_layers"])
    )


def parse_qwen3_moe(hf: dict[str, Any]) -> ModelConfig:
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    n = hf["num_hidden_layers"]
    return ModelConfig(
        **common_fields(hf, 1e-6),
        layer_types=("sliding_attention" if window else "full_attention",) * n,
        mlp_types=qwen_mlp_types(hf, qwen_experts(hf, 0)),
        intermediate_size=hf.get("intermediate_size", 6144),
        num_experts=qwen_experts(hf, 128),
        top_k=hf.get("num_experts_per_tok", 8),
        moe_intermediate_size=hf.get("moe_intermediate_size", 768),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        qkv_bias=bool(hf.get("attention_bias", False)),
        o_bias=bool(hf.get("attention_bias", False)),
        qk_norm=True,
        sliding_window=window,
    )


def parse_qwen2_moe(hf: dict[str, Any]) -> ModelConfig:
    n = hf["num_hidden_layers"]
    use_window = bool(hf.get("use_sliding_window", False))
    max_window_layers = hf.get("max_window_layers", 28)
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 and i < max_window_layers and use_window else "full_attention"
        for i in range(n)
    ]
    return ModelConfig(
        **common_fields(hf, 1e-6),
        layer_types=tuple(layer_types),
        mlp_types=qwen_mlp_types(hf, qwen_experts(hf, 0)),
        intermediate_size=hf.get("intermediate_size", 5632),
        num_experts=qwen_experts(hf, 60),
        top_k=hf.get("num_experts_per_tok", 4),
        moe_intermediate_size=hf.get("moe_intermediate_size", 1408),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 5632),
        shared_expert_gated=True,
        qkv_bias=bool(hf.get("qkv_bias", True)),
        sliding_window=(hf.get("sliding_window") or None) if use_window else None,
    )


def parse_mixtral(hf: dict[str, Any]) -> ModelConfig:
    n = hf["num_hidden_layers"]
    window = hf.get("sliding_window")
    return ModelConfig(
        **common_fields(hf, 1e-5),
        layer_types=("sliding_attention" if window else "full_attention",) * n,
        mlp_types=("moe",) * n,
        intermediate_size=hf.get("intermediate_size", 14336),
        num_experts=hf.get("num_local_experts", 8),
        top_k=hf.get("num_experts_per_tok", 2),
        moe_intermediate_size=hf.get("intermediate_size", 14336),
        norm_topk_prob=True,
        router_weights_fp32=True,
        sliding_window=window,
    )


def parse_glm4_moe(hf: dict[str, Any]) -> ModelConfig:
    n = hf["num_hidden_layers"]
    dense = hf.get("first_k_dense_replace", 1)
    moe_inter = hf.get("moe_intermediate_size", 1408)
    return ModelConfig(
        **common_fields(hf, 1e-5),
        layer_types=("full_attention",) * n,
        mlp_types=tuple("dense" if i < dense else "moe" for i in range(n)),
        intermediate_size=hf.get("intermediate_size", 10944),
        num_experts=hf.get("n_routed_experts", 128),
        top_k=hf.get("num_experts_per_tok", 8),
        moe_intermediate_size=moe_inter,
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        shared_expert_intermediate_size=moe_inter * hf.get("n_shared_experts", 1),
        router_weights_fp32=True,
        qkv_bias=bool(hf.get("attention_bias", False)),
        qk_norm=bool(hf.get("use_qk_norm", False)),
        router="sigmoid-grouped",
        n_group=hf.get("n_group", 1),
        topk_group=hf.get("topk_group", 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
    )


def _glm4_key(key: str, cfg: ModelConfig | None = None) -> str | ExpertKey | None:
    """GLM-4.5's names: `shared_experts` (one ungated MLP), the router's `e_score_correction_bias`; the
    MTP layers stored past the last decoder layer (`num_nextn_predict_layers`) are not loaded."""
    m = re.match(r"^model\.layers\.(\d+)\.", key)
    if m and cfg is not None and int(m[1]) >= cfg.num_layers:
        return None
    key = key.replace(".mlp.shared_experts.", ".mlp.shared_expert.")
    key = key.replace(".mlp.gate.e_score_correction_bias", ".mlp.score_bias")
    return qwen_expert_key(key)


for _type, _parse, _map in (
    ("qwen3_moe", parse_qwen3_moe, qwen_expert_key),
    ("qwen2_moe", parse_qwen2_moe, qwen_expert_key),
    ("mixtral", parse_mixtral, _mixtral_key),
    ("glm4_moe", parse_glm4_moe, _glm4_key),
):
    register_architecture(Architecture(_type, _parse, MoECausalLM, _map))
