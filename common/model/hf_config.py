"""Read a model directory's config.json (+ generation_config.json) into a ModelConfig."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from common.config import ModelConfig
from common.model.architectures import get_architecture
from common.model.checkpoint import read_json as read_json  # re-exported: callers take it from here
from common.model.errors import CheckpointError
from common.model.quantization import detect_quantization
from common.model.registry import Architecture


def load_architecture(model_dir: str | Path) -> tuple[Architecture, ModelConfig]:
    """The architecture and parsed config of the model in `model_dir`, whose declared quantization is checked
    first (an unsupported one is refused before anything else: common/model/quantization.py)."""
    detect_quantization(model_dir)
    path = Path(model_dir) / "config.json"
    arch, cfg = parse_architecture(read_json(path), path)
    return arch, _with_generation_eos(cfg, Path(model_dir) / "generation_config.json")


_INT_FIELDS = {
    "vocab_size": 1, "hidden_size": 1, "num_hidden_layers": 1, "num_attention_heads": 1,
    "num_key_value_heads": 1, "head_dim": 1, "max_position_embeddings": 1, "intermediate_size": 0,
    "num_experts": 0, "num_local_experts": 0, "num_experts_per_tok": 0, "moe_intermediate_size": 0,
    "shared_expert_intermediate_size": 0, "decoder_sparse_step": 1,
}  # fmt: skip
"""config.json's integer fields (in text_config too) and their least value: checked before parsing, so a
string or a negative size is named by its key rather than met by torch as a shape."""
_HF_NAMES = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "max_position": "max_position_embeddings",
    "top_k": "num_experts_per_tok",
}
"""ModelConfig's fields named otherwise in config.json."""


def parse_architecture(hf: dict[str, Any], path: Path) -> tuple[Architecture, ModelConfig]:
    """The architecture and parsed config of a config.json dict; errors name `path`."""
    model_type = hf.get("model_type")
    if model_type is None:
        raise CheckpointError("config has no model_type", path, "model_type")
    if not isinstance(model_type, str):
        raise CheckpointError(f"model_type must be a string, got {model_type!r}", path, "model_type")
    _check_fields(hf, path)
    try:
        arch = get_architecture(model_type)
    except KeyError as exc:
        raise CheckpointError(str(exc.args[0]), path, "model_type") from exc
    try:
        cfg = arch.parse_config(hf)
    except KeyError as exc:
        raise CheckpointError("required field missing", path, str(exc.args[0])) from exc
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"invalid config: {exc}", path) from exc
    _check_parsed(cfg, "text_config." if isinstance(hf.get("text_config"), dict) else "", path)
    return arch, cfg


def _check_fields(hf: dict[str, Any], path: Path) -> None:
    """The integer fields present in config.json (or its text_config) are integers of at least their least
    value; `mlp_only_layers` is a list of layer indices."""
    text = hf.get("text_config")
    for prefix, fields in (("", hf), ("text_config.", text if isinstance(text, dict) else {})):
        for name, low in _INT_FIELDS.items():
            value = fields.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise CheckpointError(
                    f"must be an integer of at least {low}, got {value!r}", path, prefix + name
                )
        only = fields.get("mlp_only_layers")
        if only is not None and not (isinstance(only, list) and all(type(i) is int for i in only)):
            raise CheckpointError(
                f"must be a list of layer indices, got {only!r}", path, prefix + "mlp_only_layers"
            )


def _check_parsed(cfg: ModelConfig, prefix: str, path: Path) -> None:
    """What holds once parsed (defaults and derived fields included): positive sizes, a positive norm
    epsilon, at most as many experts a token as there are, whole key/value head groups."""

    def bad(field: str, message: str) -> CheckpointError:
        return CheckpointError(message, path, prefix + _HF_NAMES.get(field, field))

    for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
        value = getattr(cfg, field)  # null in config.json, or no default to fall back on
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad(field, f"must be a positive integer, got {value!r}")
    eps = cfg.rms_norm_eps
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps > 0:
        raise bad("rms_norm_eps", f"must be a positive number, got {eps!r}")
    if cfg.num_experts and cfg.top_k > cfg.num_experts:
        raise bad("top_k", f"{cfg.top_k} experts a token, but each layer has {cfg.num_experts}")
    if cfg.num_heads % cfg.num_kv_heads:
        raise bad(
            "num_kv_heads", f"{cfg.num_heads} attention heads do not split into {cfg.num_kv_heads} groups"
        )


def _with_generation_eos(cfg: ModelConfig, path: Path) -> ModelConfig:
    """generation_config.json's eos ids extend config.json's (HF generate stops on either)."""
    if not path.is_file():
        return cfg
    eos = read_json(path).get("eos_token_id")
    extra = eos if isinstance(eos, list) else [] if eos is None else [eos]
    merged = tuple(dict.fromkeys([*cfg.eos_token_ids, *extra]))
    return dataclasses.replace(cfg, eos_token_ids=merged)
