"""qwen4_exp (Qwen3.8-Flash-Next): registers the architecture and maps its checkpoint keys."""

from __future__ import annotations

import re

from common.model.families import qwen_expert_key
from common.model.qwen4_exp.config import parse_qwen4_exp
from common.model.qwen4_exp.model import Qwen4ExpForCausalLM
from common.model.registry import Architecture, ExpertKey, HostTableKey, register_architecture

_TABLE = re.compile(
    r"^(model\.layers\.\d+\.ple)\.ple_embedding\.ngram_embedding\.shard_(\d+)\.(weight|weight_scale_inv)$"
)
_IGNORED = re.compile(
    r"^(mtp\.|model\.visual\.|model\.layers\.\d+\.ple\.ple_embedding\.(layer_multipliers|ngram_heads_))"
)


def map_qwen4_key(key: str) -> str | ExpertKey | HostTableKey | None:
    """Checkpoint key → runtime name (multimodal checkpoints nest the text model in model.language_model)."""
    key = key.replace("model.language_model.", "model.", 1)
    if _IGNORED.match(key):
        return None  # MTP and vision come later; the hash buffers are derived from the config
    if m := _TABLE.match(key):
        return HostTableKey(m[1], int(m[2]), "weight" if m[3] == "weight" else "scale")
    return qwen_expert_key(key)


for _type in ("qwen4_exp", "qwen4_exp_text"):
    register_architecture(Architecture(_type, parse_qwen4_exp, Qwen4ExpForCausalLM, map_qwen4_key))
