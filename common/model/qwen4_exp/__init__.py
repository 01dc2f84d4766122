"""qwen4_exp (Qwen3.8-Flash-Next): registers the architecture and maps its checkpoint keys."""

from __future__ import annotations

import re

from common.config import ModelConfig
from common.model.families import qwen_expert_key
from common.model.provider import ExpertProvider
from common.model.qwen4_exp.config import Qwen4ExpConfig, parse_qwen4_exp
from common.model.qwen4_exp.model import Qwen4ExpForCausalLM
from common.model.registry import Architecture, ExpertKey, HostTableKey, register_architecture

_TABLE = re.compile(
    r"^(model\.layers\.\d+\.ple)\.ple_embedding\.ngram_embedding\.shard_(\d+)\.(weight|weight_scale_inv)$"
)
_IGNORED = re.compile(
    r"^(model\.visual\.|model\.layers\.\d+\.ple\.ple_embedding\.(layer_multipliers|ngram_heads_))"
)
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")


def map_qwen4_key(key: str, cfg: ModelConfig) -> str | ExpertKey | HostTableKey | None:
    """Checkpoint key → runtime name (multimodal checkpoints nest the text model in model.language_model)."""
    key = key.replace("model.language_model.", "model.", 1)
    if _IGNORED.match(key):
        return None  # the vision tower comes later; the hash buffers are derived from the config
    if key.startswith("mtp."):
        assert isinstance(cfg, Qwen4ExpConfig)  # parse_qwen4_exp's
        return _mtp_key(key, cfg)
    if m := _TABLE.match(key):
        return HostTableKey(m[1], int(m[2]), "weight" if m[3] == "weight" else "scale")
    return qwen_expert_key(key)


def _mtp_key(key: str, cfg: Qwen4ExpConfig) -> str | ExpertKey | None:
    """mtp.* keys load only when the head is built; its experts are the provider's layer num_layers + i."""
    m = _MTP_LAYER.match(key)
    if not cfg.mtp_layers or (m and int(m[1]) >= cfg.mtp_layers):
        return None
    if m and ".mlp.experts." in key:
        target = qwen_expert_key(f"model.layers.{cfg.num_layers + int(m[1])}.{key[m.end() :]}")
        if isinstance(target, ExpertKey):
            return target
    return key


def build_qwen4(cfg: ModelConfig, experts: ExpertProvider) -> Qwen4ExpForCausalLM:
    """The model for `cfg` (parse_qwen4_exp's), parameters uninitialised."""
    assert isinstance(cfg, Qwen4ExpConfig)
    return Qwen4ExpForCausalLM(cfg, experts)


for _type in ("qwen4_exp", "qwen4_exp_text"):
    register_architecture(Architecture(_type, parse_qwen4_exp, build_qwen4, map_qwen4_key))
