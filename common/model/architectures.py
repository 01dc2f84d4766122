"""The architectures a checkpoint's model_type names: the built-in ones register themselves on import."""

from __future__ import annotations

import common.model.families
import common.model.qwen3_5_moe
import common.model.qwen3_next
import common.model.qwen4_exp  # noqa: F401  (these imports register the built-in architectures)
from common.model.registry import ARCHITECTURES, Architecture


def get_architecture(model_type: str) -> Architecture:
    """The registered architecture for `model_type`; KeyError names the supported ones."""
    if model_type not in ARCHITECTURES:
        raise KeyError(f"model_type {model_type!r} is not supported (supported: {sorted(ARCHITECTURES)})")
    return ARCHITECTURES[model_type]
