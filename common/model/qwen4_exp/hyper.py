"""Hyper-connections: `hc_count` residual streams, mixed into each sublayer's input, re-injected after it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.model.qwen4_exp.config import Qwen4ExpConfig
from common.model.qwen4_exp.norms import OffsetRMSNorm


class HyperConnection(nn.Module):
    """Gated low-rank mix of the normalised streams → the sublayer input; per-stream injection weights.

    The streams are one tensor [T, hc · H], stream s at columns [s·H, (s+1)·H).
    """

    fused_decode = False
    """Run the elementwise work as three Triton kernels (common/kernels/hyper.py) instead of ~30 torch ops.
    Opt-in until measured on the GPU (see `common.kernels.use_fused_kernels`)."""

    def __init__(self, cfg: Qwen4ExpConfig, inject: bool = True) -> None:
        super().__init__()
        self.hc, self.hidden = cfg.hc_count, cfg.hidden_size
        self.hc_norm = OffsetRMSNorm(cfg.hc_hidden, cfg.rms_norm_eps, group=cfg.hidden_size)
        self.input_mix_weight_down = nn.Linear(cfg.hc_hidden, cfg.hc_lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(cfg.hc_lowrank, cfg.hc_hidden, bias=False)
        self.block_inject_weight = nn.Linear(cfg.hc_hidden, cfg.hc_count, bias=False) if inject else None

    def mix(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """streams [T, hc·H] → (sublayer input [T, H], normalised streams [T, hc·H])."""
        if self.fused_decode:
            from common.kernels.hyper import hc_mix, hc_norm  # Triton

            normed = hc_norm(streams, self.hc_norm.weight, self.hc_norm.eps, self.hc)
            gate = F.silu(self.input_mix_weight_down(normed) / self.hc)
            return hc_mix(self.input_mix_weight_up(gate), normed, self.hc), normed
        normed = self.hc_norm(streams)
        gate = F.silu(self.input_mix_weight_down(normed) / self.hc)
        gate = torch.sigmoid(self.input_mix_weight_up(gate)).unflatten(
            -1, (self.hc, self.hidden)
        )  # [T, hc, H]
        return (gate * normed.unflatten(-1, (self.hc, self.hidden))).mean(dim=-2), normed

    def forward(self, streams: torch.Tensor, sublayer) -> torch.Tensor:
        """streams + sublayer(mix(streams)) injected into every stream with its learned weight."""
        mixed, normed = self.mix(streams)
        if self.fused_decode:
            from common.kernels.hyper import hc_inject  # Triton

            logits = self.block_inject_weight(normed)  # [T, hc]
            return hc_inject(streams, sublayer(mixed), logits)
        inject = 2 * torch.sigmoid(self.block_inject_weight(normed) / self.hc)  # [T, hc]
        out = sublayer(mixed)  # [T, H]
        return streams + (out[:, None, :] * inject[:, :, None]).flatten(-2)
