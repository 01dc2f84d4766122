"""GQA self-attention with optional q/k norm, qkv bias, partial RoPE and a sliding window."""

from __future__ import annotations

import torch
from torch import nn

from common.config import ModelConfig
from common.kv.backend import kv_specs
from common.kv.state import StateSpec
from common.model.context import ForwardContext
from common.model.fused_linear import Linear
from common.model.layers import RMSNorm
from common.model.rope import apply_rotary


class Attention(nn.Module):
    """q/k/v/o projections around the attention backend; K/V live in the layer's pages."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, sliding: bool = False) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        hidden = cfg.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.scale = self.head_dim**-0.5
        self.window = cfg.sliding_window if sliding else None

    def state_specs(self, dtype: torch.dtype) -> dict[str, StateSpec]:
        return {**kv_specs(self.num_kv_heads, self.head_dim, dtype)}

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, ctx.cos, ctx.sin), apply_rotary(k, ctx.cos, ctx.sin)
        state = ctx.pool.layer(self.layer_idx)
        out = ctx.backend.forward(q, k, v, state, ctx.attn_plan, self.scale, self.window)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, -1))
