"""Qwen4ExpForCausalLM: the text model of qwen4_exp over hyper-connection streams and hybrid layers."""

from __future__ import annotations

import torch
from torch import nn

from common.kernels.config import KERNELS, KernelConfig
from common.kv.state import StateSpec
from common.model.context import ForwardContext
from common.model.fp8_linear import Fp8Fused
from common.model.groups import run_groups
from common.model.layer_major import run_layer_major
from common.model.layers import GatedMLP
from common.model.moe import SparseMoeBlock
from common.model.provider import ExpertProvider
from common.model.qwen4_exp.config import Qwen4ExpConfig
from common.model.qwen4_exp.gdn import GatedDeltaNet
from common.model.qwen4_exp.hyper import HyperConnection, Streams, applied, rows_of
from common.model.qwen4_exp.mtp import Qwen4MTP
from common.model.qwen4_exp.norms import OffsetRMSNorm
from common.model.qwen4_exp.ple import PLE
from common.model.qwen4_exp.qsa import QSAttention
from common.model.rope import RotaryEmbedding


class Qwen4DecoderLayer(nn.Module):
    """[PLE] → hyper-connected token mixer (GDN or QSA) → hyper-connected MoE. Without hyper-connections
    (qwen3_next) one stream instead: x + mixer(norm(x)), then x + mlp(norm(x)); a layer's channel mixer
    may then be a dense MLP (`mlp_types`)."""

    def __init__(
        self,
        cfg: Qwen4ExpConfig,
        layer_idx: int,
        experts: ExpertProvider,
        mixer: str | None = None,
        ple: bool = True,
    ) -> None:
        super().__init__()
        has_ple = ple and layer_idx in cfg.ple_layers
        self.ple = PLE(cfg, layer_idx, cfg.ple_layers.index(layer_idx)) if has_ple else None
        kind = mixer or cfg.layer_types[layer_idx]
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, layer_idx)
        else:
            self.self_attn = QSAttention(cfg, layer_idx, indexed=kind == "indexed_attention")
        dense = layer_idx < cfg.num_layers and cfg.mlp_types[layer_idx] == "dense"  # (MTP layers: MoE)
        self.mlp: nn.Module = (
            GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
            if dense
            else SparseMoeBlock(cfg, layer_idx, experts)
        )
        self.hyper = cfg.hyper_connections
        if self.hyper:
            self.attn_hyper_connection = HyperConnection(cfg)
            self.mlp_hyper_connection = HyperConnection(cfg)
        else:
            self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    kernels: KernelConfig = KERNELS
    """The kernel forms and launch options (set where the worker builds the model: `configure_kernels`)."""

    @property
    def mixer(self) -> GatedDeltaNet | QSAttention:
        return self.linear_attn if hasattr(self, "linear_attn") else self.self_attn

    def state_specs(self, dtype: torch.dtype) -> dict[str, StateSpec]:
        specs = dict(self.mixer.state_specs(dtype))
        if self.ple is not None:
            specs.update(self.ple.state_specs(dtype))
        return specs

    def forward(self, streams: Streams, ctx: ForwardContext, defer: bool = False) -> Streams:
        """The layer's streams after it; with `defer`, its hyper-connections may leave their injections to
        the next one's projection kernel (DeferredInject, decode rows): the caller applies the last."""
        streams = self.mix_tokens(streams, ctx, defer)
        if not self.hyper:
            x = applied(streams)
            return x + self.mlp(self.post_attention_layernorm(x))
        return self.mlp_hyper_connection(streams, self.mlp, defer)

    # The two halves a layer-major pass runs apart (common/model/layer_major.py).
    def mix_tokens(self, streams: Streams, ctx: ForwardContext, defer: bool = False) -> Streams:
        if self.ple is not None:
            streams = applied(streams)
            streams = streams + self.ple(streams, ctx)
        if not self.hyper:
            x = applied(streams)
            return x + self.mixer(self.input_layernorm(x), ctx)
        hold = self._holds_mixer_launch(rows_of(streams))
        return self.attn_hyper_connection(streams, lambda h: self.mixer(h, ctx), defer, hold_next=hold)

    def _holds_mixer_launch(self, rows: int) -> bool:
        """`hold_mixer_launch` for a pass of `rows` tokens."""
        if self.kernels.hold_mixer_launch is not None:
            return self.kernels.hold_mixer_launch
        fused = self.mixer.fused_in
        if not isinstance(fused, Fp8Fused):
            return False
        from common.kernels.gemv import wide_fp8  # Triton

        return wide_fp8(rows, fused.weight.shape[0], self.kernels)

    def ffn_input(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the MoE's input [T, H], the injection logits [T, hc]; None: one stream)."""
        if not self.hyper:
            return self.post_attention_layernorm(streams), None
        return self.mlp_hyper_connection.mix_input(streams)

    def ffn_output(
        self, streams: torch.Tensor, out: torch.Tensor, logits: torch.Tensor | None
    ) -> torch.Tensor:
        if logits is None:  # one stream
            return streams + out
        return applied(self.mlp_hyper_connection.inject(streams, out, logits))  # (not deferred: a tensor)


class Qwen4Backbone(nn.Module):
    def __init__(self, cfg: Qwen4ExpConfig, experts: ExpertProvider) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen4DecoderLayer(cfg, i, experts) for i in range(cfg.num_layers))
        if cfg.hyper_connections:
            self.hyper_connection_mixer = HyperConnection(cfg, inject=False)
        else:  # one stream: a final norm
            self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen4ExpForCausalLM(nn.Module):
    """Embedding copied into `hc_count` streams, decoder layers, a final stream mixer, lm_head (without
    hyper-connections: one stream and a final norm)."""

    def __init__(self, cfg: Qwen4ExpConfig, experts: ExpertProvider) -> None:
        super().__init__()
        self.config = cfg
        self.experts = experts
        self.model = Qwen4Backbone(cfg, experts)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position)
        self.mtp = Qwen4MTP(cfg, experts, Qwen4DecoderLayer) if cfg.mtp_layers else None
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def state_specs(self, dtype: torch.dtype) -> list[dict[str, StateSpec]]:
        """Per layer (trunk, then MTP), the per-sequence state it keeps."""
        layers = [*self.model.layers, *(self.mtp.layers if self.mtp is not None else [])]
        return [layer.state_specs(dtype) for layer in layers]

    def forward(self, ctx: ForwardContext) -> torch.Tensor:
        """Final mixed hidden states [T, H] for every token of the batch."""
        return self.mix(self.forward_streams(ctx))

    def forward_streams(self, ctx: ForwardContext) -> torch.Tensor:
        """The trunk's streams [T, hc·H] before the final mixer (what the MTP head reads)."""
        streams = self._embed(ctx)
        for layer in self.model.layers:
            streams = layer(streams, ctx, defer=True)
        return applied(streams)

    def forward_chunks(self, contexts: list[ForwardContext]) -> torch.Tensor:
        """One sequence's consecutive chunks layer by layer (`ModelRunner.prefill_layer_major`) → the last
        chunk's final mixed hidden states [T, H]."""
        streams = run_layer_major(self.model.layers, [self._embed(c) for c in contexts], contexts)
        return self.mix(streams[-1])

    def forward_groups(self, contexts: list[ForwardContext]) -> torch.Tensor:
        """A decode pass's lanes in groups (common/model/groups.py) → the final mixed hidden states [T, H] of
        every lane, the groups' in order."""
        streams = run_groups(self.model.layers, [self._embed(c) for c in contexts], contexts, self.experts)
        return self.mix(torch.cat(streams))

    def _embed(self, ctx: ForwardContext) -> torch.Tensor:
        """The batch's embeddings copied into the streams [T, hc·H] (a prompt's image tokens take the vision
        encoder's); the rotary cos/sin set on ctx."""
        x = self.model.embed_tokens(ctx.batch.input_ids)  # [T, H]
        if ctx.batch.image_rows is not None:
            rows, embeds = ctx.batch.image_rows  # [N], [N, H]
            x[rows] = embeds.to(x.dtype)
        self._set_rotary(ctx, x.dtype)
        return x.repeat(1, self.config.hc_count) if self.config.hyper_connections else x

    def mix(self, streams: torch.Tensor) -> torch.Tensor:
        """The final mixer (one stream: the final norm): streams [T, hc·H] → hidden [T, H]."""
        if not self.config.hyper_connections:
            return self.model.norm(streams)
        return self.model.hyper_connection_mixer.mix(streams)

    def draft(self, streams: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP pass: row t pairs streams[t] with token ctx.batch.input_ids[t] (the next one) at its position.

        Returns (draft logits [T, V] fp32, MTP streams [T, hc·H] for a chained draft step).
        """
        assert self.mtp is not None, "a model built without its MTP head drafts nothing"
        embeds = self.model.embed_tokens(ctx.batch.input_ids)
        self._set_rotary(ctx, embeds.dtype)
        hidden, out_streams = self.mtp(streams, embeds, ctx)
        return self.compute_logits(hidden), out_streams

    def _set_rotary(self, ctx: ForwardContext, dtype: torch.dtype) -> None:
        ctx.rotary, ctx.rotary_dtype = self.rotary, dtype  # cos/sin on first use (`ctx.cos`)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
