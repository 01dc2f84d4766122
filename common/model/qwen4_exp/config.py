"""Qwen4ExpConfig: the text model of qwen4_exp (Qwen3.8-Flash-Next), parsed from config.json.

Real checkpoints are `Qwen4ExpForConditionalGeneration`: the text fields sit under `text_config`. A text-only
config (`model_type` `qwen4_exp_text`) has them at the top level. Defaults are transformers' own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from common.config import ModelConfig, RopeConfig
from common.model.rope_config import parse_rope


@dataclass(frozen=True)
class Qwen4ExpConfig(ModelConfig):
    """ModelConfig plus the hybrid-attention, hyper-connection and PLE fields of qwen4_exp.

    Its layer_types: `linear_attention` (Gated DeltaNet), `indexed_attention` (gated attention over the keys
    the QSA indexer selects) and `full_attention` (gated attention over every key, no indexer: qwen3_next).
    """

    linear_num_key_heads: int = 16
    """Gated DeltaNet query/key heads."""
    linear_num_value_heads: int = 32
    """Gated DeltaNet value heads (each key head serves value_heads / key_heads of them)."""
    linear_key_head_dim: int = 128
    """Gated DeltaNet query/key head width."""
    linear_value_head_dim: int = 128
    """Gated DeltaNet value head width."""
    linear_conv_kernel_dim: int = 4
    """Depthwise causal conv kernel over the qkv projection."""
    output_gate_act: str = "silu"
    """Activation of the gate in the linear-attention output norm."""
    hyper_connections: bool = True
    """Residual streams mixed by hyper-connections (`hc_*`). False: one pre-norm residual stream instead
    (`input_layernorm`, `post_attention_layernorm` and a final `norm`, (1 + w) RMSNorms), as qwen3_next;
    hc_count is then 1."""
    hc_count: int = 4
    """Hyper-connection residual streams."""
    hc_lowrank: int = 320
    """Rank of the hyper-connection input mixer."""
    ple_layer_ids: tuple[int, ...] = ()
    """One-indexed layers that add the PLE n-gram module before their mixer."""
    ple_embed_dim: int = 0
    """Width of one token's concatenated n-gram embedding."""
    ple_conv_kernel_size: int = 4
    """Kernel of PLE's dilated causal conv (dilation = ngram_size)."""
    ngram_size: int = 3
    """Longest n-gram hashed by PLE."""
    heads_per_ngram: int = 8
    """Hash heads per n-gram order."""
    ngram_vocab_size_base: int = 20_000_000
    """Each head's vocabulary is a prime after this."""
    ngram_vocab_divisible_by: int = 128
    """The n-gram table's rows are padded to a multiple of this."""
    ngram_seed: int = 1234
    """Seed of the hash multipliers."""
    split_ngram_parts: int = 512
    """Row shards the checkpoint stores the n-gram table in."""
    indexer_n_heads: int = 0
    """QSA indexer query heads."""
    indexer_head_dim: int = 0
    """QSA indexer head width."""
    indexer_budget: int = 2048
    """Most keys a QSA query attends to (plus the tail of its current block)."""
    indexer_compress_ratio: int = 4
    """Tokens per compressed indexer block."""
    mtp_layers: int = 0
    """MTP layers built (0 unless speculative decoding asks for the head)."""
    checkpoint_mtp_layers: int = 0
    """MTP layers the checkpoint holds (`mtp_num_hidden_layers`)."""

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The trunk layers whose channel mixer is the MoE (every one in qwen4_exp), then the MTP layers'
        (indices num_layers, ...)."""
        return (*super().moe_layers, *range(self.num_layers, self.num_layers + self.mtp_layers))

    @property
    def ple_layers(self) -> tuple[int, ...]:
        """Zero-indexed layers with a PLE module."""
        return tuple(i - 1 for i in self.ple_layer_ids)

    @property
    def hc_hidden(self) -> int:
        return self.hc_count * self.hidden_size


def text_section(hf: dict[str, Any]) -> dict[str, Any]:
    """The text model's fields: `text_config` of a multimodal config, else the config itself."""
    return hf.get("text_config", hf)


def parse_qwen4_exp(hf: dict[str, Any]) -> Qwen4ExpConfig:
    """HF config.json (multimodal or text-only) → Qwen4ExpConfig."""
    t = text_section(hf)
    n = t["num_hidden_layers"]
    types = t.get("layer_types") or [
        "linear_attention" if (i + 1) % t.get("full_attention_interval", 4) else "indexed_attention"
        for i in range(n)
    ]
    types = ["indexed_attention" if x == "full_attention" else x for x in types]
    eos = t.get("eos_token_id", hf.get("eos_token_id"))
    eos_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
    heads = t.get("num_attention_heads", 16)
    hidden = t.get("hidden_size", 2048)
    tie = bool(hf.get("tie_word_embeddings", t.get("tie_word_embeddings", False)))
    return Qwen4ExpConfig(
        model_type="qwen4_exp",
        vocab_size=t.get("vocab_size", 248320),
        hidden_size=hidden,
        num_layers=n,
        num_heads=heads,
        num_kv_heads=t.get("num_key_value_heads", 2),
        head_dim=t.get("head_dim", 256),
        rms_norm_eps=t.get("rms_norm_eps", 1e-6),
        max_position=t.get("max_position_embeddings", 32768),
        rope=_with_mrope_default(parse_rope(t)),
        layer_types=tuple(types),
        mlp_types=("moe",) * n,
        intermediate_size=0,
        num_experts=t.get("num_experts", 512),
        top_k=t.get("num_experts_per_tok", 10),
        moe_intermediate_size=t.get("moe_intermediate_size", 512),
        norm_topk_prob=bool(t.get("norm_topk_prob", True)),
        shared_expert_intermediate_size=t.get("shared_expert_intermediate_size", 512),
        shared_expert_gated=True,
        qkv_bias=bool(t.get("attention_bias", False)),
        o_bias=bool(t.get("attention_bias", False)),
        qk_norm=True,
        hidden_act=t.get("hidden_act", "silu"),
        tie_word_embeddings=tie,
        bos_token_id=t.get("bos_token_id"),
        eos_token_ids=eos_ids,
        torch_dtype=str(t.get("torch_dtype") or t.get("dtype") or hf.get("torch_dtype") or "bfloat16"),
        linear_num_key_heads=t.get("linear_num_key_heads", 16),
        linear_num_value_heads=t.get("linear_num_value_heads", 32),
        linear_key_head_dim=t.get("linear_key_head_dim", 128),
        linear_value_head_dim=t.get("linear_value_head_dim", 128),
        linear_conv_kernel_dim=t.get("linear_conv_kernel_dim", 4),
        output_gate_act=t.get("output_gate_type") or t.get("hidden_act", "silu"),
        hc_count=t.get("hc_count", 4),
        hc_lowrank=t.get("hc_lowrank", 320),
        ple_layer_ids=tuple(sorted(set(t.get("ple_layer_ids") or []))),
        ple_embed_dim=t.get("ple_embed_dim") or hidden,
        ple_conv_kernel_size=t.get("ple_conv_kernel_size", 4),
        ngram_size=t.get("ngram_size", 3),
        heads_per_ngram=t.get("heads_per_ngram", 8),
        ngram_vocab_size_base=t.get("ngram_vocab_size_base", 20_000_000),
        ngram_vocab_divisible_by=t.get("make_ngram_vocab_size_divisible_by", 128),
        ngram_seed=t.get("seed", 1234),
        split_ngram_parts=t.get("split_ngram_parts", 512),
        indexer_n_heads=t.get("indexer_n_heads") or 0,
        indexer_head_dim=t.get("indexer_head_dim") or 0,
        indexer_budget=t.get("indexer_budget") or 2048,
        indexer_compress_ratio=t.get("indexer_compress_ratio") or 4,
        checkpoint_mtp_layers=t.get("mtp_num_hidden_layers", 0),
    )


def _with_mrope_default(rope: RopeConfig) -> RopeConfig:
    """transformers' qwen4_exp rotates images with sections (11, 11, 10) where the config names none."""
    return rope if rope.mrope_section else dataclasses.replace(rope, mrope_section=(11, 11, 10))
