"""qwen4_exp's norms: RMSNorm scaled by (1 + w), optionally per group, and the gated output norm of GDN."""

from __future__ import annotations

import torch
from torch import nn

from common.model.layers import activation


class OffsetRMSNorm(nn.Module):
    """RMSNorm in fp32 with weight (1 + w), cast after the weight; `group` normalises each slice alone."""

    def __init__(self, dim: int, eps: float, group: int | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps, self.group = eps, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        if self.group is not None:
            x32 = x32.unflatten(-1, (-1, self.group))
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.group is not None:
            x32 = x32.flatten(-2)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        """forward(x) of a grouped norm, x [T, groups·group], in one Triton kernel (a group a program): torch
        makes ~8 fp32 passes over x."""
        from common.kernels.hyper import hc_norm  # Triton

        assert self.group is not None, "fused is a grouped norm's"
        return hc_norm(x, self.weight, self.eps, x.shape[-1] // self.group)


class GatedRMSNorm(nn.Module):
    """weight · RMSNorm(x) · act(gate): the output norm of the linear-attention layers (weight used as is)."""

    def __init__(self, dim: int, eps: float, act: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.act, self.act_name = activation(act), act

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(dtype)
        return (out * self.act(gate.float())).to(dtype)
