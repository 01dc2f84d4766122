"""The synthetic checkpoints' model families and named sizes (presets): the config.json fields of each
(common/model/synthetic/checkpoint.py writes them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "qwen4_exp", "qwen3_next")
# The families with one flat config.json and weights under `model.` and standard attention in every layer.
FLAT_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe")

# The synthetic tokenizer's size; the model's vocab may be larger (real checkpoints pad their embeddings).
TOKENIZER_VOCAB = 1024
EOS_TOKEN_ID = 2  # <|im_end|>
PAD_TOKEN_ID = 0  # <|endoftext|>

ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "qwen4_exp": "Qwen4ExpForConditionalGeneration",
    "qwen3_next": "Qwen3NextForCausalLM",
}
STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Tensors whose dtype is fixed whatever the checkpoint's torch_dtype (qwen4_exp's n-gram hash buffers).
BUFFER_DTYPES = {"int64": torch.int64}
# Fixed by the arch argument; overriding them would write keys that contradict the config.
FROZEN_FIELDS = ("model_type", "architectures")
# qwen4_exp: where the text weights live in the checkpoint.
QWEN4_TEXT_PREFIX = "model.language_model"
# qwen4_exp: `--set` keys that belong inside text_config.rope_parameters (unless text_config has the key).
ROPE_KEYS = ("rope_type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")


@dataclass(frozen=True)
class Preset:
    """A named model size: the full config.json fields for each arch it supports, and its shard size.
    ``plan_only``: `spillway plan` reads it, make-model refuses to write it (a release-sized checkpoint
    no test or benchmark writes)."""

    configs: Mapping[str, Mapping[str, Any]]
    shard_bytes: int
    plan_only: bool = False

    @property
    def default_arch(self) -> str:
        return next(iter(self.configs))


# ---------------------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------------------

# Shared by every tiny arch. head_dim is deliberately != hidden_size / num_attention_heads (64 / 4 = 16) so
# that code which derives it instead of reading it fails loudly.
_TINY_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": TOKENIZER_VOCAB,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "use_cache": True,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
}

# qwen4_exp text_config fields that every preset shares (transformers' defaults, which the release uses).
# `layer_types` is derived after overrides from num_hidden_layers and full_attention_interval (three
# "linear_attention" layers, then one "full_attention" layer, which transformers reads as
# "indexed_attention"), and rope_parameters.mrope_section from the rotary dim, unless either is overridden.
_TINY_GDN = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}
"""The tiny hybrids' Gated DeltaNet: each key head serving two value heads."""

_QWEN4_TEXT_COMMON: dict[str, Any] = {
    "model_type": "qwen4_exp_text",
    "hidden_act": "silu",
    "output_gate_type": None,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "use_cache": True,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "norm_topk_prob": True,
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "hc_count": 4,
    "ple_conv_kernel_size": 4,
    "ngram_size": 3,
    "heads_per_ngram": 8,
    "make_ngram_vocab_size_divisible_by": 128,
    "seed": 1234,
    "indexer_kv_heads": 1,
    "indexer_compress_ratio": 4,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_interleaved": True,
    },
    "bos_token_id": None,
    "pad_token_id": None,
    "eos_token_id": EOS_TOKEN_ID,
}

# transformers' Qwen4ExpVisionConfig defaults. `out_hidden_size` follows the text hidden_size unless
# overridden (`--set vision_config.out_hidden_size=N`).
_QWEN4_VISION: dict[str, Any] = {
    "model_type": "qwen4_exp_vision",
    "depth": 27,
    "hidden_size": 1152,
    "hidden_act": "gelu_pytorch_tanh",
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 2304,
    "initializer_range": 0.02,
}

# Every qwen4_exp feature on, a few MB, fast on CPU: GDN layers 0-2 (PLE on layer 1), a QSA layer 3 whose
# indexer keeps 16 tokens in blocks of 4 (prompts longer than 16 + 4 - 1 = 19 tokens exercise the sparse
# selection), a 16-head n-gram table of 16896 rows x 4 in 4 shards.
_TINY_QWEN4: dict[str, Any] = {
    "text_config": {
        **_QWEN4_TEXT_COMMON,
        "vocab_size": TOKENIZER_VOCAB,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 4096,
        **_TINY_GDN,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "hc_lowrank": 16,
        "ple_layer_ids": [2],
        "ple_embed_dim": 64,
        "ngram_vocab_size_base": 1000,
        "split_ngram_parts": 4,
        "mtp_num_hidden_layers": 1,
        "indexer_n_heads": 2,
        "indexer_head_dim": 32,
        "indexer_budget": 16,
    },
    "vision_config": {
        **_QWEN4_VISION,
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "num_position_embeddings": 64,
    },
    "tie_word_embeddings": False,
    # The synthetic tokenizer's vision tokens (make_model checks that they agree): the top of its vocab, laid
    # out as in the release (start, end, pad, image, video).
    "vision_start_token_id": TOKENIZER_VOCAB - 5,
    "vision_end_token_id": TOKENIZER_VOCAB - 4,
    "image_token_id": TOKENIZER_VOCAB - 2,
    "video_token_id": TOKENIZER_VOCAB - 1,
}

# qwen3_next in transformers 5's spellings, field for field what its Qwen3NextConfig writes (rope_parameters,
# layer_types; torch_dtype, as every synthetic config, for its `dtype`): Gated DeltaNet layers 0 and 2 (each
# key head serving two value heads), gated full attention on layers 1 and 3, layer 1's MLP dense.
_TINY_QWEN3_NEXT: dict[str, Any] = {
    **{k: v for k, v in _TINY_COMMON.items() if k not in ("rope_theta", "rope_scaling")},
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "linear_conv_kernel_dim": 4,
    **_TINY_GDN,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "intermediate_size": 96,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],
    "attention_bias": False,
    "pad_token_id": None,
}

_TINY: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        **_TINY_COMMON,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "intermediate_size": 96,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 4,
    },
    "qwen2_moe": {
        **_TINY_COMMON,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "intermediate_size": 96,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
        "qkv_bias": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 4,
    },
    "mixtral": {
        **_TINY_COMMON,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 32,
        "sliding_window": None,
        "router_jitter_noise": 0.0,
    },
    "glm4_moe": {
        **{k: v for k, v in _TINY_COMMON.items() if k not in ("rope_theta", "rope_scaling")},
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "intermediate_size": 96,
        "first_k_dense_replace": 1,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 1.5,
        "norm_topk_prob": True,
        "use_qk_norm": True,
        "attention_bias": True,
        "num_nextn_predict_layers": 0,
    },
    "qwen4_exp": _TINY_QWEN4,
    "qwen3_next": _TINY_QWEN3_NEXT,
}

# Qwen/Qwen3-30B-A3B config.json, field for field (token ids aside: ours follow the synthetic tokenizer).
_QWEN3_30B: dict[str, Any] = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# GLM-4.5-Air (Glm4MoeForCausalLM): transformers' Glm4MoeConfig defaults, which are its config.json's (106B
# parameters, 12B active; the MTP layer, num_nextn_predict_layers 1 there, left out: it is not served).
_GLM45_AIR: dict[str, Any] = {
    "attention_bias": True,
    "attention_dropout": 0.0,
    "first_k_dense_replace": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 10944,
    "max_position_embeddings": 131072,
    "moe_intermediate_size": 1408,
    "n_group": 1,
    "n_routed_experts": 128,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 96,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 46,
    "num_key_value_heads": 8,
    "num_nextn_predict_layers": 0,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
    "routed_scaling_factor": 1.0,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "use_cache": True,
    "use_qk_norm": False,
    "vocab_size": 151552,
}

# Qwen3.8-Flash-Next (Qwen4ExpForConditionalGeneration), text config field for field (token ids aside: ours
# follow the synthetic tokenizer; the vision token ids are the release's). ~125.7B trunk parameters (120.8B
# of them routed experts: 48 layers x 512) plus the PLE n-gram table of layer 1: 16 prime-sized heads of
# ~20M rows, 320,001,536 rows x 160 = 51.2B parameters (102 GB in bf16), in 512 shards of 625,003 rows.
# Benchmarks shrink the table tenfold with `--set ngram_vocab_size_base=2000000` (5.1B parameters, 32,002,176
# rows in 512 shards of 62,505 rows, the last 62,121) and the trunk with `--set num_hidden_layers=N` (PLE
# stays on layer id 2, so N = 1 also needs `--set ple_layer_ids=[1]`, or `[]` for no table).
_FLASHNEXT: dict[str, Any] = {
    "text_config": {
        **_QWEN4_TEXT_COMMON,
        "vocab_size": 248320,
        "hidden_size": 2560,
        "num_hidden_layers": 48,
        "num_attention_heads": 24,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "max_position_embeddings": 262144,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 640,
        "shared_expert_intermediate_size": 640,
        "hc_lowrank": 320,
        "ple_layer_ids": [2],
        "ple_embed_dim": 2560,
        "ngram_vocab_size_base": 20_000_000,
        "split_ngram_parts": 512,
        "mtp_num_hidden_layers": 1,
        "indexer_n_heads": 4,
        "indexer_head_dim": 128,
        "indexer_budget": 2048,
    },
    "vision_config": dict(_QWEN4_VISION),
    "tie_word_embeddings": False,
    "vision_start_token_id": 248053,
    "vision_end_token_id": 248054,
    "image_token_id": 248056,
    "video_token_id": 248057,
}

# Qwen/Qwen3-Next-80B-A3B-Instruct (Qwen3NextForCausalLM), its config.json's fields in the release's
# spellings (token ids aside: ours follow the synthetic tokenizer). The sizes are transformers'
# Qwen3NextConfig defaults; the release differs from those in rope_theta (1e7), max_position_embeddings
# (262144) and the unused dense intermediate_size (5120). ~79.7B parameters, 77.3B of them routed experts (48
# layers x 512); the MTP layer (mtp_num_hidden_layers 1 there) left out: it is not served.
_QWEN3_NEXT_80B: dict[str, Any] = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "decoder_sparse_step": 1,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "mlp_only_layers": [],
    "moe_intermediate_size": 512,
    "norm_topk_prob": True,
    "num_attention_heads": 16,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "num_hidden_layers": 48,
    "num_key_value_heads": 2,
    "output_router_logits": False,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 10000000.0,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False,
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

PRESETS: dict[str, Preset] = {
    # 256 KiB shards: the tiny model (~0.8 MB in bf16; qwen4_exp ~1.2 MB) spans several, which exercises
    # the index.
    "tiny": Preset(configs=_TINY, shard_bytes=256 * 1024),
    # "4GB" as Hugging Face counts it (10**9): ~61 GB of bf16 -> 16 shards, like the published checkpoint.
    "qwen3-30b": Preset(configs={"qwen3_moe": _QWEN3_30B}, shard_bytes=4 * 10**9),
    # ~354 GB of bf16 (251 GB trunk + 102 GB n-gram table) in 90 shards of 4 GB; see _FLASHNEXT for the
    # `--set` overrides that benchmarks use to shrink it.
    "flashnext": Preset(configs={"qwen4_exp": _FLASHNEXT}, shard_bytes=4 * 10**9),
    "glm-4.5-air": Preset(configs={"glm4_moe": _GLM45_AIR}, shard_bytes=5 * 10**9),
    # ~159 GB of bf16: planned, not written (make-model writes qwen3_next with the tiny preset).
    "qwen3-next-80b": Preset(configs={"qwen3_next": _QWEN3_NEXT_80B}, shard_bytes=4 * 10**9, plan_only=True),
}
