"""Triton kernels for the GPU paths (each module imports triton: import them where they are used)."""

from __future__ import annotations

from torch import nn


def use_fused_decode(model: nn.Module, on: bool = True) -> None:
    """Switch the fused kernels that are still opt-in on or off for `model`: the one-program cache
    resolution (resolve.py, decode passes of an offloaded provider), the Gated DeltaNet step
    (gated_delta.py, decode passes) and the hyper-connections' elementwise work (hyper.py, every pass).
    They need CUDA, or Triton's interpreter (tests)."""
    from common.model.qwen4_exp.gdn import GatedDeltaNet
    from common.model.qwen4_exp.hyper import HyperConnection

    for module in model.modules():
        if isinstance(module, (GatedDeltaNet, HyperConnection)):
            module.fused_decode = on
    if hasattr(model.experts, "fused_resolve"):
        model.experts.fused_resolve = on
