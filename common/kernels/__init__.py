"""Triton kernels for the GPU paths (each module imports triton: import them where they are used)."""

from __future__ import annotations

from torch import nn


def use_fused_decode(model: nn.Module, on: bool = True) -> None:
    """Switch the fused decode kernels that are still opt-in — the one-program cache resolution
    (common/kernels/resolve.py) and the Gated DeltaNet step (common/kernels/gated_delta.py) — on or off for
    `model` (its expert provider and its linear-attention layers)."""
    from common.model.qwen4_exp.gdn import GatedDeltaNet

    for module in model.modules():
        if isinstance(module, GatedDeltaNet):
            module.fused_decode = on
    if hasattr(model.experts, "fused_resolve"):
        model.experts.fused_resolve = on
