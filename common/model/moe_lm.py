"""MoECausalLM: the pre-norm decoder shared by qwen3_moe, qwen2_moe and mixtral.

Module names follow the HF checkpoints (`model.layers.{i}.self_attn.q_proj`, ...), so most checkpoint keys
load by name; routed experts are not parameters of this tree but live in the expert provider.
"""

from __future__ import annotations

import torch
from torch import nn

from common.config import ModelConfig
from common.kv.state import StatefulMixer, StateSpec
from common.model.attention import Attention
from common.model.context import ForwardContext
from common.model.groups import run_groups
from common.model.layer_major import run_layer_major
from common.model.layers import GatedMLP, RMSNorm
from common.model.moe import SparseMoeBlock
from common.model.provider import ExpertProvider
from common.model.registry import CHANNEL_MIXERS, TOKEN_MIXERS
from common.model.rope import RotaryEmbedding

TOKEN_MIXERS["full_attention"] = lambda cfg, i: Attention(cfg, i)
TOKEN_MIXERS["sliding_attention"] = lambda cfg, i: Attention(cfg, i, sliding=True)
CHANNEL_MIXERS["moe"] = lambda cfg, i, experts: SparseMoeBlock(cfg, i, experts)
CHANNEL_MIXERS["dense"] = lambda cfg, i, experts: GatedMLP(
    cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act
)


class DecoderLayer(nn.Module):
    """x + mixer(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, experts: ExpertProvider) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = TOKEN_MIXERS[cfg.layer_types[layer_idx]](cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = CHANNEL_MIXERS[cfg.mlp_types[layer_idx]](cfg, layer_idx, experts)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.mix_tokens(x, ctx)
        h, _ = self.ffn_input(x)
        return self.ffn_output(x, self.mlp(h), None)

    # The two halves a layer-major pass runs apart (common/model/layer_major.py).
    def mix_tokens(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return x + self.self_attn(self.input_layernorm(x), ctx)

    def ffn_input(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.post_attention_layernorm(x), None

    def ffn_output(self, x: torch.Tensor, out: torch.Tensor, aux: None) -> torch.Tensor:
        return x + out


class Backbone(nn.Module):
    """Embedding, decoder layers, final norm (HF's `model.` prefix)."""

    def __init__(self, cfg: ModelConfig, experts: ExpertProvider) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, experts) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MoECausalLM(nn.Module):
    """Decoder-only MoE language model over a flat batch with paged per-sequence state."""

    def __init__(self, cfg: ModelConfig, experts: ExpertProvider) -> None:
        super().__init__()
        self.config = cfg
        self.experts = experts
        self.model = Backbone(cfg, experts)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with lm_head where the config says so (again after materialising from meta)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def state_specs(self, dtype: torch.dtype) -> list[dict[str, StateSpec]]:
        """Per layer, the per-sequence state its token mixer keeps."""
        out = []
        for layer in self.model.layers:
            mixer = layer.get_submodule("self_attn")
            assert isinstance(mixer, StatefulMixer)
            out.append(mixer.state_specs(dtype))
        return out

    def forward(self, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states [T, H] after the final norm for every token of the batch."""
        x = self._embed(ctx)
        for layer in self.model.layers:
            x = layer(x, ctx)
        return self.model.norm(x)

    def forward_chunks(self, contexts: list[ForwardContext]) -> torch.Tensor:
        """One sequence's consecutive chunks layer by layer (`ModelRunner.prefill_layer_major`) → the last
        chunk's hidden states [T, H] after the final norm."""
        xs = run_layer_major(self.model.layers, [self._embed(c) for c in contexts], contexts)
        return self.model.norm(xs[-1])

    def forward_groups(self, contexts: list[ForwardContext]) -> torch.Tensor:
        """A decode pass's lanes in groups (common/model/groups.py) → hidden states [T, H] after the final
        norm, the groups' lanes in order."""
        xs = run_groups(self.model.layers, [self._embed(c) for c in contexts], contexts, self.experts)
        return self.model.norm(torch.cat(xs))

    def _embed(self, ctx: ForwardContext) -> torch.Tensor:
        """The batch's embeddings [T, H]; the rotary embedding set on ctx (its cos/sin: `ctx.cos`)."""
        x = self.model.embed_tokens(ctx.batch.input_ids)
        ctx.rotary, ctx.rotary_dtype = self.rotary, x.dtype
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] → [N, V] logits in fp32."""
        return self.lm_head(hidden).float()
