"""PLE: hashed n-gram embeddings injected into every hyper-connection stream (qwen4_exp layer index 1).

Each token's bi- and trigram hashes pick rows of the host-resident n-gram table; their concatenation is
projected to one value and one key per stream; the normalised streams gate the value, and a dilated causal
conv adds local context. Per-sequence state: the last n−1 token ids and the conv history.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from common.kernels.config import KERNELS, KernelConfig
from common.kv.state import SlotSpec, StateSpec
from common.model.context import ForwardContext
from common.model.fused_linear import FusedLinears, fuse_linears, project
from common.model.host_rows import HostRows
from common.model.ngram import NGramSpec, ngram_ids
from common.model.qwen4_exp.config import Qwen4ExpConfig
from common.model.qwen4_exp.norms import OffsetRMSNorm
from common.model.qwen4_exp.varlen import Padding, causal_conv


class PLE(nn.Module):
    """The per-layer n-gram embedding module; `table` is attached by the loader (host memory)."""

    fused_decode = False
    """Decode steps' n-gram hashing, gate and conv, and prefill passes' conv, through Triton kernels
    (`use_fused_kernels`)."""

    kernels: KernelConfig = KERNELS
    """The kernel forms and launch options (set where the worker builds the model: `configure_kernels`)."""

    def __init__(self, cfg: Qwen4ExpConfig, layer_idx: int, ple_index: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.hc, self.hidden = cfg.hc_count, cfg.hidden_size
        eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else 0
        self.spec = NGramSpec.build(
            cfg.vocab_size,
            cfg.ngram_size,
            cfg.heads_per_ngram,
            cfg.ngram_vocab_size_base,
            cfg.ngram_vocab_divisible_by,
            cfg.ngram_seed,
            ple_index,
            eos,
        )
        self.table_parts = cfg.split_ngram_parts
        self.table: HostRows | None = None
        self.dilation = cfg.ngram_size
        self.conv_history = (cfg.ple_conv_kernel_size - 1) * self.dilation
        embed, streams = cfg.ple_embed_dim, cfg.hc_hidden
        self.key_proj = nn.Linear(embed, streams, bias=False)
        self.value_proj = nn.Linear(embed, self.hidden, bias=False)
        self.norm_key = OffsetRMSNorm(streams, cfg.rms_norm_eps, group=self.hidden)
        self.norm_query = OffsetRMSNorm(streams, cfg.rms_norm_eps, group=self.hidden)
        self.norm_conv = OffsetRMSNorm(streams, cfg.rms_norm_eps, group=self.hidden)
        self.conv1d = nn.Conv1d(
            streams, streams, cfg.ple_conv_kernel_size, groups=streams, dilation=self.dilation, bias=False
        )
        self.fused_in: FusedLinears | None = None  # key_proj and value_proj as one GEMM (fuse_projections)

    def table_shape(self) -> tuple[int, int]:
        """(rows, row width) the attached table must have."""
        return self.spec.table_rows, self.key_proj.in_features // self.spec.num_heads

    def attach_table(self, table: HostRows) -> None:
        self.table = table

    def state_specs(self, dtype: torch.dtype) -> dict[str, StateSpec]:
        return {
            "ngram_ctx": SlotSpec((self.spec.ngram_size - 1,), torch.int64, fill=self.spec.eos_token_id),
            "ple_conv": SlotSpec((self.hc * self.hidden, self.conv_history), dtype),
        }

    def fuse_projections(self, copy: bool = True) -> bool:
        """Run key_proj and value_proj (both read the gathered rows) as one GEMM from now on
        (common/model/fused_linear.py)."""
        self.fused_in = fuse_linears((self.key_proj, self.value_proj), copy)
        return self.fused_in is not None

    def forward(self, streams: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """What PLE adds to the streams [T, hc·H]."""
        assert self.table is not None, "attach_table first"
        emb = self.table.lookup(self._hash(ctx), streams.dtype).flatten(-2)  # [T, E]
        key, value = project(emb, (self.key_proj, self.value_proj), self.fused_in)  # [T, hc·H], [T, H]
        history, weight = ctx.pool.layer(self.layer_idx).slots["ple_conv"], self.conv1d.weight[:, 0]
        slots = ctx.batch.slot_ids
        if self.fused_decode and ctx.batch.is_decode:  # two kernels (~25 in torch)
            from common.kernels.causal_conv import conv_step  # Triton
            from common.kernels.ple import ple_gate

            norms = (self.norm_key.weight, self.norm_query.weight, self.norm_conv.weight)
            gated, conv_in = ple_gate(key, streams, value, norms, self.norm_key.eps, self.hc, self.kernels)
            conv = conv_step(conv_in, history, slots, weight, self.dilation, silu=True, kernels=self.kernels)
            return gated + conv
        gated = self.gate(key, streams, value)
        conv_in, pad = self._norm(self.norm_conv, gated), Padding.of(ctx.batch)
        if self.fused_decode:  # prefill passes
            from common.kernels.causal_conv import conv_prefill  # Triton

            conv = conv_prefill(
                conv_in, history, slots, weight, pad.seq, pad.offset, pad.lens, self.dilation, True
            )
            return gated + conv
        return gated + F.silu(causal_conv(conv_in, history, slots, weight, pad, self.dilation))

    def gate(self, key: torch.Tensor, streams: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """The value [T, H] gated for each stream [T, hc·H] by its normalised key's agreement with it (the
        torch ops; `ple_gate` in decode steps with the fused kernels)."""
        split = (self.hc, self.hidden)
        key = self._norm(self.norm_key, key).unflatten(-1, split)  # [T, hc, H]
        query = self._norm(self.norm_query, streams).unflatten(-1, split)
        gate = (key * query).sum(-1, keepdim=True) / math.sqrt(self.hidden)  # [T, hc, 1]
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        return (torch.sigmoid(gate) * value[:, None, :]).flatten(-2)  # [T, hc·H]

    def _norm(self, norm: OffsetRMSNorm, x: torch.Tensor) -> torch.Tensor:
        return norm.fused(x) if self.fused_decode else norm(x)

    def _hash(self, ctx: ForwardContext) -> torch.Tensor:
        """Table rows [T, heads] of this pass's tokens; advances each sequence's n-gram context."""
        batch = ctx.batch
        context = ctx.pool.layer(self.layer_idx).slots["ngram_ctx"]
        if self.fused_decode and batch.is_decode:  # one token a sequence: one kernel (~50 in torch)
            from common.kernels.ngram import ngram_step  # Triton

            return ngram_step(self.spec, context, batch.input_ids, batch.slot_ids, self.kernels)
        pad = Padding.of(batch)
        prev = context[batch.slot_ids]  # [B, n-1]
        history = torch.cat([prev, pad.pad(batch.input_ids, self.spec.eos_token_id)], dim=1)  # [B, n-1+Lmax]
        ids = pad.unpad(ngram_ids(self.spec, history, pad.max_len))  # [T, heads]
        keep = pad.lens[:, None] + torch.arange(prev.shape[1], device=prev.device)[None, :]
        context[batch.slot_ids] = history.gather(1, keep)
        return ids
