"""Triton kernels for the GPU paths (each module imports triton: import them where they are used)."""

from __future__ import annotations

import torch

GEMV_ROWS = 16
"""Most rows of input the Triton GEMV (gemv.py) takes; more run as a GEMM."""


def fused_by_default(fused: bool | None, device: torch.device | str) -> bool:
    """Whether the fused kernels run: `fused` as given, or (None) where the device is CUDA."""
    return torch.device(device).type == "cuda" if fused is None else fused
