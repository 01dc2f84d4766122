"""Architecture and layer registries.

An `Architecture` ties an HF `model_type` to: how its config.json is parsed, how its model is built, and how
its checkpoint keys map onto the runtime's parameter names. Token mixers (attention, linear attention, ...)
and channel mixers (dense MLP, MoE) are registered by the layer-type strings a ModelConfig lists per layer,
so a new family adds entries here instead of editing the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from common.config import ModelConfig
from common.model.checkpoint import TensorSource
from common.model.provider import ExpertProvider


@dataclass(frozen=True)
class ExpertKey:
    """A checkpoint key that holds routed-expert weights (they go to the provider, not the module tree)."""

    layer: int
    expert: int | None
    """None for a fused key holding every expert of the layer."""
    part: str
    """`gate`, `up` or `down` (per expert), `gate_up` or `down` (fused)."""


@dataclass(frozen=True)
class HostTableKey:
    """A row shard (or its scale) of a table kept in host memory, owned by the module named `owner`."""

    owner: str
    shard: int
    part: str
    """`weight` or `scale` (fp8 tables: dequantised rows = weight · scale)."""


KeyMapper = Callable[[str, ModelConfig], "str | ExpertKey | HostTableKey | None"]
SourceAdapter = Callable[[TensorSource, ModelConfig], TensorSource]


@dataclass(frozen=True)
class Architecture:
    """One HF model family."""

    model_type: str
    parse_config: Callable[[dict[str, Any]], ModelConfig]
    """config.json dict → ModelConfig (raises ValueError on unsupported settings)."""
    build: Callable[[ModelConfig, ExpertProvider], nn.Module]
    """ModelConfig + expert provider → the model, parameters uninitialised."""
    map_key: KeyMapper
    """(checkpoint key, config) → runtime parameter name, ExpertKey, HostTableKey, or None (ignored)."""
    adapt_source: SourceAdapter | None = None
    """The checkpoint's tensors → the tensors `map_key` names, where the family stores some in another
    layout than the runtime's (qwen3_next's interleaved Gated DeltaNet projections); applied after any
    dequantisation. Must pass through tensors already in the runtime's layout (a converted artifact's)."""


ARCHITECTURES: dict[str, Architecture] = {}

TokenMixerFactory = Callable[[ModelConfig, int], nn.Module]
ChannelMixerFactory = Callable[[ModelConfig, int, ExpertProvider], nn.Module]
TOKEN_MIXERS: dict[str, TokenMixerFactory] = {}
CHANNEL_MIXERS: dict[str, ChannelMixerFactory] = {}


def register_architecture(arch: Architecture) -> Architecture:
    ARCHITECTURES[arch.model_type] = arch
    return arch
