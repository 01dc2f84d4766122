"""The MTP head of qwen4_exp: one extra QSA + MoE layer that drafts the token after next.

Row p pairs the trunk's pre-mixer streams h_p [hc·H] with the embedding of token p+1: both are normalised
((1 + w) RMSNorm; one statistic over all hc·H values of h), projected to H (one matrix shared by the streams
of h), summed into every stream, then run through one hyper-connected QSA/MoE layer (no PLE) at position p and
a final stream mixer; the shared lm_head turns its output into the draft for token p+2. Its output streams
stand in for h when drafts chain. The layer keeps its own K/V and indexer state (layer index num_layers).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from common.model.context import ForwardContext
from common.model.provider import ExpertProvider
from common.model.qwen4_exp.config import Qwen4ExpConfig
from common.model.qwen4_exp.hyper import HyperConnection
from common.model.qwen4_exp.norms import OffsetRMSNorm


class Qwen4MTP(nn.Module):
    """mtp.*: fc_embedding / fc_hidden with their norms, one decoder layer, a stream mixer."""

    def __init__(self, cfg: Qwen4ExpConfig, experts: ExpertProvider, layer: Callable[..., nn.Module]) -> None:
        """`layer`: the decoder layer's class (model.py's Qwen4DecoderLayer)."""
        super().__init__()
        self.hc, self.hidden = cfg.hc_count, cfg.hidden_size
        self.pre_fc_norm_embedding = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = OffsetRMSNorm(cfg.hc_hidden, cfg.rms_norm_eps)
        self.fc_embedding = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.fc_hidden = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList(
            layer(cfg, cfg.num_layers + i, experts, mixer="indexed_attention", ple=False)
            for i in range(cfg.mtp_layers)
        )
        self.hyper_connection_mixer = HyperConnection(cfg, inject=False)

    def forward(
        self, streams: torch.Tensor, next_embeds: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """streams [T, hc·H], embeddings of the next tokens [T, H] → (hidden [T, H], streams [T, hc·H])."""
        e = self.fc_embedding(self.pre_fc_norm_embedding(next_embeds))  # [T, H]
        h = self.fc_hidden(
            self.pre_fc_norm_hidden(streams).unflatten(-1, (self.hc, self.hidden))
        )  # [T, hc, H]
        x = (h + e[:, None, :]).flatten(-2)
        for layer in self.layers:
            x = layer(x, ctx)
        return self.hyper_connection_mixer.mix(x), x
