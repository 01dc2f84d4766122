"""Small building blocks shared by every architecture: RMSNorm, gated MLP, activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str):
    """The activation function HF names `name`."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported (supported: {sorted(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back before the weight, as HF's Llama-family norms do."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): the dense MLP and the shared expert."""

    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(self.gate_proj(x), self.up_proj(x))

    def finish(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The MLP given its gate and up projections' outputs (a caller that fused them with others)."""
        return self.down_proj(self.act(gate) * up)
