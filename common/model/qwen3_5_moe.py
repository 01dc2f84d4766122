"""qwen3_5_moe (Qwen3.5-MoE, e.g. Qwen3.5-35B-A3B), its text model: qwen3_next's model in another layout.

What transformers' Qwen3_5Moe text model changes of Qwen3-Next's: the Gated DeltaNet input projections are
saved unfused (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`: the runtime's own layout, no source
adapter); every layer is MoE and the router always renormalises its top-k; RoPE is M-RoPE (`mrope_section`,
`mrope_interleaved`), which for text (one position on all three axes) is plain RoPE. The rest is
Qwen3-Next's. The release is multimodal (`qwen3_5_moe`: the text fields in `text_config`, its weights under
`model.language_model.`, a vision tower under `model.visual.`, not loaded yet); `Qwen3_5MoeForCausalLM`
saves the text model alone (`qwen3_5_moe_text`, flat keys). The MTP head is not loaded.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from common.config import ModelConfig
from common.model.qwen3_next import map_qwen3_next_key, parse_qwen3_next
from common.model.qwen4_exp import build_qwen4
from common.model.qwen4_exp.config import Qwen4ExpConfig, text_section
from common.model.registry import Architecture, ExpertKey, register_architecture

_DEFAULTS = {
    "num_experts": 256,
    "num_experts_per_tok": 8,
}  # transformers' where they differ from qwen3_next's
_ALL_MOE = {"mlp_only_layers": [], "decoder_sparse_step": 1, "norm_topk_prob": True}


def parse_qwen3_5_moe(hf: dict[str, Any]) -> Qwen4ExpConfig:
    """HF config.json (multimodal `qwen3_5_moe` or text-only `qwen3_5_moe_text`) → Qwen4ExpConfig, as
    parse_qwen3_next reads the text model's fields; the top level's `tie_word_embeddings` (the multimodal
    model's own), and its `eos_token_id` and dtype where the text section's are absent or null."""
    t = {**_DEFAULTS, **text_section(hf), **_ALL_MOE, "model_type": hf["model_type"]}
    for key in ("eos_token_id", "torch_dtype", "dtype"):
        if t.get(key) is None and hf.get(key) is not None:
            t[key] = hf[key]
    if "tie_word_embeddings" in hf:
        t["tie_word_embeddings"] = hf["tie_word_embeddings"]
    cfg = parse_qwen3_next(t)
    return dataclasses.replace(cfg, rope=dataclasses.replace(cfg.rope, mrope_section=()))


def map_qwen3_5_moe_key(key: str, cfg: ModelConfig) -> str | ExpertKey | None:
    """Checkpoint key → runtime name: the nested text model's as the flat one's, the vision tower left out,
    the rest as qwen3_next's (its MTP head left out)."""
    key = key.replace("model.language_model.", "model.", 1)
    if key.startswith("model.visual."):
        return None
    return map_qwen3_next_key(key, cfg)


for _type in ("qwen3_5_moe", "qwen3_5_moe_text"):
    register_architecture(Architecture(_type, parse_qwen3_5_moe, build_qwen4, map_qwen3_5_moe_key))
