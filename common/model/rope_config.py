"""Parse RoPE parameters from the forms HF config.json files use."""

from __future__ import annotations

from typing import Any

from common.config import RopeConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


def parse_rope(hf: dict[str, Any], default_theta: float = 10000.0) -> RopeConfig:
    """RopeConfig from `rope_parameters` (transformers 5) or legacy `rope_theta` + `rope_scaling`.

    Raises ValueError for a scaling type Spillway does not implement, rather than silently ignoring it.
    """
    params: dict[str, Any] = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    for key, value in legacy.items():
        params.setdefault(key, value)
    theta = float(params.get("rope_theta", hf.get("rope_theta", default_theta)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
    original = params.get("original_max_position_embeddings")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))

    def get(key: str, default: Any) -> Any:
        value = params.get(key)
        return default if value is None else value

    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(get("factor", 1.0)),
        original_max_position=None if original is None else int(original),
        attention_factor=params.get("attention_factor"),
        beta_fast=float(get("beta_fast", 32.0)),
        beta_slow=float(get("beta_slow", 1.0)),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(get("truncate", True)),
        low_freq_factor=float(get("low_freq_factor", 1.0)),
        high_freq_factor=float(get("high_freq_factor", 4.0)),
        partial_rotary_factor=float(partial),
        mrope_section=tuple(int(n) for n in params.get("mrope_section") or ()),
    )
