"""Synthetic MoE checkpoints in the real Hugging Face on-disk format.

No real weights can be downloaded where this project is developed and tested, so this module writes
checkpoints that look exactly like the published ones (config.json in the legacy form, per-expert
tensor names, sharded safetensors with an index, a tokenizer) but hold deterministic random weights.
Four families are supported: ``qwen3_moe``, ``qwen2_moe`` and ``mixtral`` (one flat config.json, weights
under ``model.``), and ``qwen4_exp`` (Qwen3.8-Flash-Next: a nested multimodal config.json with
``text_config`` and ``vision_config``, text weights under ``model.language_model.``; hybrid Gated DeltaNet /
QSA-indexed attention layers, hyper-connections, and a hashed n-gram per-layer embedding (PLE) whose table
is stored as ``split_ngram_parts`` row shards). qwen4_exp checkpoints have no vision-tower or MTP weights yet.

``synthetic_tensors`` yields the weights one tensor at a time without touching the disk (byte for byte what
``make_model`` writes), so a machine with little disk can build a large checkpoint straight in memory.

Weights are chosen so that the model is *informative*: logits have a wide spread and routing is
decisive, so comparing two implementations (ours against transformers) on logits and greedy tokens
is meaningful rather than dominated by near-ties.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from common.experts.formats import FP8_BLOCK, quantize_fp8_block
from common.model.ngram import NGramSpec, ngram_shard_rows

log = logging.getLogger(__name__)

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "qwen4_exp")
# The families with one flat config.json and weights under `model.`.
FLAT_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")

# The synthetic tokenizer's size; the model's vocab may be larger (real checkpoints pad their embeddings).
TOKENIZER_VOCAB = 1024
EOS_TOKEN_ID = 2  # <|im_end|>
PAD_TOKEN_ID = 0  # <|endoftext|>

_ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen4_exp": "Qwen4ExpForConditionalGeneration",
}
_STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Tensors whose dtype is fixed whatever the checkpoint's torch_dtype (qwen4_exp's n-gram hash buffers).
_BUFFER_DTYPES = {"int64": torch.int64}
# Fixed by the arch argument; overriding them would write keys that contradict the config.
_FROZEN_FIELDS = ("model_type", "architectures")
# qwen4_exp: where the text weights live in the checkpoint.
QWEN4_TEXT_PREFIX = "model.language_model"
# qwen4_exp: `--set` keys that belong inside text_config.rope_parameters (unless text_config has the key).
_ROPE_KEYS = ("rope_type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")


@dataclass(frozen=True)
class Preset:
    """A named model size: the full config.json fields for each arch it supports, and its shard size."""

    configs: Mapping[str, Mapping[str, Any]]
    shard_bytes: int

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
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
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
    # The synthetic tokenizer has no vision tokens: the top of its vocab, laid out as in the release
    # (start, end, pad, image, video).
    "vision_start_token_id": TOKENIZER_VOCAB - 5,
    "vision_end_token_id": TOKENIZER_VOCAB - 4,
    "image_token_id": TOKENIZER_VOCAB - 2,
    "video_token_id": TOKENIZER_VOCAB - 1,
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
    "qwen4_exp": _TINY_QWEN4,
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

PRESETS: dict[str, Preset] = {
    # 256 KiB shards: the tiny model (~0.8 MB in bf16; qwen4_exp ~1.2 MB) spans several, which exercises
    # the index.
    "tiny": Preset(configs=_TINY, shard_bytes=256 * 1024),
    # "4GB" as Hugging Face counts it (10**9): ~61 GB of bf16 -> 16 shards, like the published checkpoint.
    "qwen3-30b": Preset(configs={"qwen3_moe": _QWEN3_30B}, shard_bytes=4 * 10**9),
    # ~354 GB of bf16 (251 GB trunk + 102 GB n-gram table) in 90 shards of 4 GB; see _FLASHNEXT for the
    # `--set` overrides that benchmarks use to shrink it.
    "flashnext": Preset(configs={"qwen4_exp": _FLASHNEXT}, shard_bytes=4 * 10**9),
}


# ---------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """Parse ``KEY=VALUE`` strings into a dict.

    VALUE is parsed as JSON where it can be (``6`` -> 6, ``false`` -> False, ``[0]`` -> [0],
    ``null`` -> None) and kept as a string otherwise. An item without ``=`` or with an empty key
    raises ValueError naming it.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"malformed override {item!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def _resolve(preset: str, arch: str | None) -> tuple[Preset, str]:
    """Validate (preset, arch); a missing arch means the preset's first one."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    if arch is None:
        return p, p.default_arch
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {list(ARCHS)}")
    if arch not in p.configs:
        raise ValueError(f"preset {preset!r} does not support arch {arch!r}; it supports {list(p.configs)}")
    return p, arch


def model_config(preset: str, arch: str | None, overrides: Mapping[str, Any] | None) -> dict:
    """Return the config.json dict for ``preset``/``arch`` with ``overrides`` applied, without writing.

    The flat families' dict is in the legacy form real checkpoints use (``rope_theta``, ``rope_scaling``,
    ``torch_dtype``) plus ``architectures`` and ``model_type``. qwen4_exp's is the release's nested form
    (see ``_qwen4_config`` for where overrides go).
    """
    p, arch = _resolve(preset, arch)
    overrides = dict(overrides or {})
    frozen = sorted(k for k in overrides if k in _FROZEN_FIELDS or k.rpartition(".")[2] == "model_type")
    if frozen:
        raise ValueError(f"cannot override {frozen}; pick the family with arch= (one of {list(ARCHS)})")
    if arch == "qwen4_exp":
        cfg = _qwen4_config(p.configs[arch], overrides)
    else:
        cfg = {
            "architectures": [_ARCHITECTURES[arch]],
            "model_type": arch,
            "torch_dtype": "bfloat16",
            # The synthetic tokenizer has no BOS; generation stops on <|im_end|> (and <|endoftext|>, see
            # generation_config.json).
            "bos_token_id": None,
            "eos_token_id": EOS_TOKEN_ID,
            **_copy(p.configs[arch]),  # deep copy: callers may mutate the result
            **overrides,
        }
    if cfg["torch_dtype"] not in _STORAGE_DTYPES:
        raise ValueError(
            f"torch_dtype {cfg['torch_dtype']!r} not supported; choose one of {list(_STORAGE_DTYPES)}"
        )
    return cfg


def _copy(obj: Any) -> Any:
    return json.loads(json.dumps(obj))


def text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's fields of a config.json dict: qwen4_exp's ``text_config``, else ``cfg`` itself."""
    return cfg["text_config"] if cfg.get("model_type") == "qwen4_exp" else cfg


def _qwen4_config(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """qwen4_exp's config.json: ``base`` (a preset) with ``overrides``, derived fields filled in, validated.

    An override key goes to the top level where the top level has it (``tie_word_embeddings``,
    ``image_token_id``, ``torch_dtype``; ``tie_word_embeddings`` is mirrored into text_config, where
    transformers also keeps it), into ``text_config.rope_parameters`` for the RoPE keys (``rope_theta``,
    ``partial_rotary_factor``, ``mrope_section``, ...), into ``vision_config`` / ``text_config`` for a dotted
    ``vision_config.KEY`` / ``text_config.KEY``, and into ``text_config`` otherwise.
    """
    cfg: dict[str, Any] = {
        "architectures": [_ARCHITECTURES["qwen4_exp"]],
        "model_type": "qwen4_exp",
        **_copy(base),
        "torch_dtype": "bfloat16",
    }
    for key, value in overrides.items():
        value = _copy(value)
        section, dot, sub = key.partition(".")
        text = cfg["text_config"]
        if dot and section in ("text_config", "vision_config"):
            cfg[section][sub] = value
        elif key in cfg:
            cfg[key] = value
            if key in text:
                text[key] = value
        elif key in _ROPE_KEYS and key not in text:
            if not isinstance(text.get("rope_parameters"), dict):
                text["rope_parameters"] = {}
            text["rope_parameters"][key] = value
        else:
            text[key] = value

    text, vision = cfg["text_config"], cfg["vision_config"]
    interval = text.get("full_attention_interval", 4)
    text.setdefault(
        "layer_types",
        [
            "linear_attention" if (i + 1) % interval else "full_attention"
            for i in range(text["num_hidden_layers"])
        ],
    )
    rope = text.get("rope_parameters")
    if isinstance(rope, dict):
        rope.setdefault(
            "mrope_section", _mrope_section(text["head_dim"], rope.get("partial_rotary_factor", 1.0))
        )
    vision.setdefault("out_hidden_size", text["hidden_size"])
    _validate_qwen4(text)
    return cfg


def _mrope_section(head_dim: int, partial_rotary_factor: float) -> list[int]:
    """[T, H, W] frequency counts of interleaved M-RoPE, summing to rotary_dim / 2.

    transformers' interleaved layout gives H the frequencies 1, 4, 7, ... below ``3 * section[1]`` and W
    2, 5, 8, ... below ``3 * section[2]``; T keeps the rest. Qwen's (head_dim 256 x 0.25) is [11, 11, 10].
    """
    half = int(head_dim * partial_rotary_factor) // 2
    h, w = len(range(1, half, 3)), len(range(2, half, 3))
    return [half - h - w, h, w]


def _validate_qwen4(text: Mapping[str, Any]) -> None:
    """The invariants the tensor shapes depend on (transformers checks the same ones on load)."""
    n, types = text["num_hidden_layers"], text["layer_types"]
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers={n}")
    unknown = sorted(set(types) - {"linear_attention", "full_attention", "indexed_attention"})
    if unknown:
        raise ValueError(f"unsupported qwen4_exp layer_types {unknown}")
    ple_ids = text.get("ple_layer_ids") or []
    bad = [i for i in ple_ids if not 1 <= i <= n or types[i - 1] != "linear_attention"]
    if bad:
        raise ValueError(
            f"ple_layer_ids are one-indexed linear_attention layers in [1, {n}]; {bad} are not "
            f"(with fewer layers, set ple_layer_ids too, e.g. ple_layer_ids=[1] or [])"
        )
    if ple_ids:
        heads = (text["ngram_size"] - 1) * text["heads_per_ngram"]
        if heads <= 0 or text["ple_embed_dim"] % heads:
            raise ValueError(
                f"ple_embed_dim {text['ple_embed_dim']} is not a multiple of the {heads} n-gram heads"
            )
    if any(t != "linear_attention" for t in types):
        missing = [
            k
            for k in ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget")
            if text.get(k) is None
        ]
        if missing:
            raise ValueError(f"qwen4_exp attention layers need the QSA indexer fields {missing}")


def generation_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """generation_config.json for ``cfg``: stop tokens and pad only, no sampling defaults."""
    return {
        "bos_token_id": cfg.get("bos_token_id"),
        "eos_token_id": [EOS_TOKEN_ID, PAD_TOKEN_ID],
        "pad_token_id": PAD_TOKEN_ID,
    }


# ---------------------------------------------------------------------------------------------------------
# Tensor plan
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: its HF key, shape, and how its values are drawn.

    ``init`` is ``"normal"`` (N(mean, std²)), ``"log_uniform"`` (log U(low, high)) or ``"const"``
    (``values``, row-major). ``dtype`` names a fixed dtype (``"int64"``); None means the checkpoint's
    torch_dtype.
    """

    key: str
    shape: tuple[int, ...]
    mean: float
    std: float
    init: str = "normal"
    low: float = 0.0
    high: float = 0.0
    values: tuple[int, ...] | None = None
    dtype: str | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def torch_dtype(self, storage: torch.dtype) -> torch.dtype:
        """The dtype this tensor is stored in, in a checkpoint whose torch_dtype is ``storage``."""
        return storage if self.dtype is None else _BUFFER_DTYPES[self.dtype]


@dataclass(frozen=True)
class ShardPlan:
    """The tensors of one safetensors file, in write order."""

    filename: str
    tensors: tuple[TensorSpec, ...]
    nbytes: int


def _linear(key: str, out_f: int, in_f: int, scale: float = 1.0) -> TensorSpec:
    # N(0, 1/fan_in) keeps activations O(1) through the stack; `scale` sharpens routers and the head.
    return TensorSpec(key, (out_f, in_f), 0.0, scale * in_f**-0.5)


def _norm(key: str, dim: int) -> TensorSpec:
    # Not exactly 1, so a runtime that forgets to apply a norm weight is caught.
    return TensorSpec(key, (dim,), 1.0, 0.1)


def _offset_norm(key: str, dim: int) -> TensorSpec:
    # An RMSNorm applied as (1 + weight) (Qwen3.5 / qwen4_exp): the weight is centred on 0, not 1.
    return TensorSpec(key, (dim,), 0.0, 0.1)


def _conv(key: str, channels: int, kernel: int) -> TensorSpec:
    # A depthwise Conv1d [channels, 1, kernel]: fan_in is the kernel size.
    return TensorSpec(key, (channels, 1, kernel), 0.0, kernel**-0.5)


def _const(key: str, values: Sequence[int]) -> TensorSpec:
    return TensorSpec(key, (len(values),), 0.0, 0.0, init="const", values=tuple(values), dtype="int64")


def _bias(key: str, dim: int) -> TensorSpec:
    return TensorSpec(key, (dim,), 0.0, 0.1)


def _head_dim(cfg: Mapping[str, Any]) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def _attention(cfg: Mapping[str, Any], p: str) -> list[TensorSpec]:
    """q/k/v/o projections (+ biases, + q/k norms for qwen3_moe) of one layer; ``p`` is the key prefix."""
    h, hd = cfg["hidden_size"], _head_dim(cfg)
    q_out, kv_out = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    arch = cfg["model_type"]
    specs = [
        _linear(f"{p}.q_proj.weight", q_out, h),
        _linear(f"{p}.k_proj.weight", kv_out, h),
        _linear(f"{p}.v_proj.weight", kv_out, h),
        _linear(f"{p}.o_proj.weight", h, q_out),
    ]
    if arch == "qwen3_moe" and cfg.get("attention_bias", False):
        specs += [
            _bias(f"{p}.{n}_proj.bias", d) for n, d in (("q", q_out), ("k", kv_out), ("v", kv_out), ("o", h))
        ]
    if arch == "qwen2_moe" and cfg.get("qkv_bias", True):  # o_proj never has a bias in Qwen2-MoE
        specs += [_bias(f"{p}.{n}_proj.bias", d) for n, d in (("q", q_out), ("k", kv_out), ("v", kv_out))]
    if arch == "qwen3_moe":
        specs += [_norm(f"{p}.q_norm.weight", hd), _norm(f"{p}.k_norm.weight", hd)]
    return specs


def _swiglu(
    p: str, h: int, inter: int, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
) -> list[TensorSpec]:
    """A SwiGLU MLP's three projections, named (gate, up, down)."""
    gate, up, down = names
    return [
        _linear(f"{p}.{gate}.weight", inter, h),
        _linear(f"{p}.{up}.weight", inter, h),
        _linear(f"{p}.{down}.weight", h, inter),
    ]


def _is_sparse(cfg: Mapping[str, Any], i: int) -> bool:
    """Whether layer ``i`` of a Qwen MoE is a sparse block (the same rule as transformers' decoder layer)."""
    return (
        i not in (cfg.get("mlp_only_layers") or [])
        and cfg["num_experts"] > 0
        and (i + 1) % cfg.get("decoder_sparse_step", 1) == 0
    )


def _qwen_mlp(cfg: Mapping[str, Any], i: int, p: str) -> list[TensorSpec]:
    h = cfg["hidden_size"]
    if not _is_sparse(cfg, i):
        return _swiglu(p, h, cfg["intermediate_size"])
    e, inter = cfg["num_experts"], cfg["moe_intermediate_size"]
    specs = [_linear(f"{p}.gate.weight", e, h, scale=2.0)]
    for j in range(e):
        specs += _swiglu(f"{p}.experts.{j}", h, inter)
    if cfg["model_type"] == "qwen2_moe":
        specs += _swiglu(f"{p}.shared_expert", h, cfg["shared_expert_intermediate_size"])
        specs.append(_linear(f"{p}.shared_expert_gate.weight", 1, h, scale=2.0))
    return specs


def _mixtral_moe(cfg: Mapping[str, Any], p: str) -> list[TensorSpec]:
    h, e, inter = cfg["hidden_size"], cfg["num_local_experts"], cfg["intermediate_size"]
    specs = [_linear(f"{p}.gate.weight", e, h, scale=2.0)]
    for j in range(e):
        specs += _swiglu(f"{p}.experts.{j}", h, inter, names=("w1", "w3", "w2"))
    return specs


# --- qwen4_exp --------------------------------------------------------------------------------------------


def _gated_deltanet(t: Mapping[str, Any], p: str) -> list[TensorSpec]:
    """A linear_attention layer's Gated DeltaNet (Qwen3.5 layout: fused q|k|v input projection)."""
    h = t["hidden_size"]
    key_dim = t["linear_num_key_heads"] * t["linear_key_head_dim"]
    v_heads = t["linear_num_value_heads"]
    value_dim = v_heads * t["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim
    return [
        _linear(f"{p}.in_proj_qkv.weight", conv_dim, h),
        _linear(f"{p}.in_proj_z.weight", value_dim, h),
        _linear(f"{p}.in_proj_b.weight", v_heads, h),
        _linear(f"{p}.in_proj_a.weight", v_heads, h),
        _conv(f"{p}.conv1d.weight", conv_dim, t["linear_conv_kernel_dim"]),
        TensorSpec(f"{p}.dt_bias", (v_heads,), 1.0, 0.1),
        # A = exp(A_log) in [0.5, 4): a moderate decay, so the recurrent state carries context.
        TensorSpec(f"{p}.A_log", (v_heads,), 0.0, 0.0, init="log_uniform", low=0.5, high=4.0),
        _norm(f"{p}.norm.weight", t["linear_value_head_dim"]),  # the gated norm multiplies by w, not 1 + w
        _linear(f"{p}.out_proj.weight", h, value_dim),
    ]


def _qsa_attention(t: Mapping[str, Any], p: str) -> list[TensorSpec]:
    """A full_attention layer: gated attention (q_proj also yields the output gate) and its QSA indexer."""
    h, hd = t["hidden_size"], t["head_dim"]
    q_out, kv_out = t["num_attention_heads"] * hd, t["num_key_value_heads"] * hd
    specs = [
        _linear(f"{p}.q_proj.weight", 2 * q_out, h),
        _linear(f"{p}.k_proj.weight", kv_out, h),
        _linear(f"{p}.v_proj.weight", kv_out, h),
        _linear(f"{p}.o_proj.weight", h, q_out),
    ]
    if t.get("attention_bias", False):
        specs += [
            _bias(f"{p}.{n}_proj.bias", d)
            for n, d in (("q", 2 * q_out), ("k", kv_out), ("v", kv_out), ("o", h))
        ]
    idx_dim = t["indexer_head_dim"]
    specs += [
        _offset_norm(f"{p}.q_norm.weight", hd),
        _offset_norm(f"{p}.k_norm.weight", hd),
        _linear(
            f"{p}.indexer.index_qk_proj.weight", (t["indexer_n_heads"] + t["indexer_kv_heads"]) * idx_dim, h
        ),
        _offset_norm(f"{p}.indexer.q_layernorm.weight", idx_dim),
        _offset_norm(f"{p}.indexer.k_layernorm.weight", idx_dim),
    ]
    return specs


def _qwen4_moe(t: Mapping[str, Any], p: str) -> list[TensorSpec]:
    """Every qwen4_exp layer is sparse: routed experts plus a sigmoid-gated shared expert."""
    h, e = t["hidden_size"], t["num_experts"]
    specs = [_linear(f"{p}.gate.weight", e, h, scale=2.0)]
    for j in range(e):
        specs += _swiglu(f"{p}.experts.{j}", h, t["moe_intermediate_size"])
    specs += _swiglu(f"{p}.shared_expert", h, t["shared_expert_intermediate_size"])
    specs.append(_linear(f"{p}.shared_expert_gate.weight", 1, h, scale=2.0))
    return specs


def ple_ngram_spec(text: Mapping[str, Any], ple_index: int) -> NGramSpec:
    """The n-gram hash parameters of the ``ple_index``-th PLE layer (its position in sorted ple_layer_ids)."""
    eos = text["eos_token_id"]
    return NGramSpec.build(
        text["vocab_size"],
        text["ngram_size"],
        text["heads_per_ngram"],
        text["ngram_vocab_size_base"],
        text["make_ngram_vocab_size_divisible_by"],
        text["seed"],
        ple_index,
        eos[0] if isinstance(eos, list) else eos,
    )


def _ple(t: Mapping[str, Any], p: str, ple_index: int) -> list[TensorSpec]:
    """A PLE layer: the hash buffers, the n-gram table in row shards, projections, norms, dilated conv."""
    spec = ple_ngram_spec(t, ple_index)
    embed_dim, hc_hidden = t["ple_embed_dim"], t["hc_count"] * t["hidden_size"]
    e = f"{p}.ple_embedding"
    specs = [
        _const(f"{e}.layer_multipliers", spec.multipliers),
        _const(f"{e}.ngram_heads_vocab_sizes", spec.head_vocab_sizes),
        _const(f"{e}.ngram_heads_offsets", spec.head_offsets),
    ]
    head_dim = embed_dim // spec.num_heads
    for j, rows in enumerate(ngram_shard_rows(spec.table_rows, t["split_ngram_parts"])):
        specs.append(TensorSpec(f"{e}.ngram_embedding.shard_{j}.weight", (rows, head_dim), 0.0, 1.0))
    specs += [
        _linear(f"{p}.key_proj.weight", hc_hidden, embed_dim),
        _linear(f"{p}.value_proj.weight", t["hidden_size"], embed_dim),
        _offset_norm(f"{p}.norm_key.weight", hc_hidden),
        _offset_norm(f"{p}.norm_query.weight", hc_hidden),
        _offset_norm(f"{p}.norm_conv.weight", hc_hidden),
        _conv(f"{p}.conv1d.weight", hc_hidden, t["ple_conv_kernel_size"]),
    ]
    return specs


def _hyper_connection(t: Mapping[str, Any], p: str, combine: bool = True) -> list[TensorSpec]:
    """A gated residual over hc_count streams: norm, low-rank input mixer, (per-block) injection weights."""
    hc, rank = t["hc_count"], t["hc_lowrank"]
    hc_hidden = hc * t["hidden_size"]
    specs = [
        _offset_norm(f"{p}.hc_norm.weight", hc_hidden),
        _linear(f"{p}.input_mix_weight_down.weight", rank, hc_hidden),
        _linear(f"{p}.input_mix_weight_up.weight", hc_hidden, rank),
    ]
    if combine:
        specs.append(_linear(f"{p}.block_inject_weight.weight", hc, hc_hidden))
    return specs


def _mtp(t: Mapping[str, Any], i: int) -> list[TensorSpec]:
    """The MTP head as the release stores it: input projections and norms once, a QSA/MoE layer (fused
    experts), and its own stream mixer (embedding and lm_head are the trunk's)."""
    h, hc_hidden = t["hidden_size"], t["hc_count"] * t["hidden_size"]
    e, inter = t["num_experts"], t["moe_intermediate_size"]
    p = f"mtp.layers.{i}"
    specs = []
    if i == 0:
        specs += [
            _offset_norm("mtp.pre_fc_norm_embedding.weight", h),
            _offset_norm("mtp.pre_fc_norm_hidden.weight", hc_hidden),
            _linear("mtp.fc_embedding.weight", h, h),
            _linear("mtp.fc_hidden.weight", h, h),
            *_hyper_connection(t, "mtp.hyper_connection_mixer", combine=False),
        ]
    specs += _qsa_attention(t, f"{p}.self_attn")
    specs += [
        _linear(f"{p}.mlp.gate.weight", e, h, scale=2.0),
        TensorSpec(f"{p}.mlp.experts.gate_up_proj", (e, 2 * inter, h), 0.0, h**-0.5),
        TensorSpec(f"{p}.mlp.experts.down_proj", (e, h, inter), 0.0, inter**-0.5),
        *_swiglu(f"{p}.mlp.shared_expert", h, t["shared_expert_intermediate_size"]),
        _linear(f"{p}.mlp.shared_expert_gate.weight", 1, h, scale=2.0),
        *_hyper_connection(t, f"{p}.attn_hyper_connection"),
        *_hyper_connection(t, f"{p}.mlp_hyper_connection"),
    ]
    return specs


def _plan_qwen4(cfg: Mapping[str, Any]) -> list[TensorSpec]:
    t = cfg["text_config"]
    h, v = t["hidden_size"], t["vocab_size"]
    m = QWEN4_TEXT_PREFIX
    ple_ids = sorted(set(t.get("ple_layer_ids") or []))
    specs = [TensorSpec(f"{m}.embed_tokens.weight", (v, h), 0.0, 1.0)]
    for i, kind in enumerate(t["layer_types"]):
        p = f"{m}.layers.{i}"
        if kind == "linear_attention":
            specs += _gated_deltanet(t, f"{p}.linear_attn")
        else:
            specs += _qsa_attention(t, f"{p}.self_attn")
        specs += _qwen4_moe(t, f"{p}.mlp")
        if i + 1 in ple_ids:
            specs += _ple(t, f"{p}.ple", ple_ids.index(i + 1))
        specs += _hyper_connection(t, f"{p}.attn_hyper_connection")
        specs += _hyper_connection(t, f"{p}.mlp_hyper_connection")
    specs += _hyper_connection(t, f"{m}.hyper_connection_mixer", combine=False)
    for i in range(t.get("mtp_num_hidden_layers", 0)):
        specs += _mtp(t, i)
    if not cfg.get("tie_word_embeddings", False):
        specs.append(_linear("lm_head.weight", v, h, scale=2.0))
    return specs


def plan_tensors(cfg: Mapping[str, Any]) -> list[TensorSpec]:
    """Every tensor of the checkpoint for ``cfg``, in module order, named as the family's HF checkpoints."""
    if cfg["model_type"] == "qwen4_exp":
        return _plan_qwen4(cfg)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    specs = [TensorSpec("model.embed_tokens.weight", (v, h), 0.0, 1.0)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        specs += _attention(cfg, f"{p}.self_attn")
        if cfg["model_type"] == "mixtral":
            specs += _mixtral_moe(cfg, f"{p}.block_sparse_moe")
        else:
            specs += _qwen_mlp(cfg, i, f"{p}.mlp")
        specs += [_norm(f"{p}.input_layernorm.weight", h), _norm(f"{p}.post_attention_layernorm.weight", h)]
    specs.append(_norm("model.norm.weight", h))
    if not cfg.get("tie_word_embeddings", False):
        specs.append(_linear("lm_head.weight", v, h, scale=2.0))
    return specs


def plan_shards(cfg: Mapping[str, Any], shard_bytes: int) -> list[ShardPlan]:
    """Assign the tensors of ``cfg`` to safetensors files of at most ``shard_bytes`` each, in module order.

    A tensor larger than ``shard_bytes`` gets a file of its own (as in transformers' save_pretrained).
    One file is named ``model.safetensors``; several are ``model-0000i-of-0000n.safetensors``.
    """
    storage = _STORAGE_DTYPES[cfg["torch_dtype"]]
    groups: list[list[TensorSpec]] = [[]]
    sizes = [0]
    for spec in plan_tensors(cfg):
        nbytes = spec.numel * spec.torch_dtype(storage).itemsize
        if groups[-1] and sizes[-1] + nbytes > shard_bytes:
            groups.append([])
            sizes.append(0)
        groups[-1].append(spec)
        sizes[-1] += nbytes
    n = len(groups)
    names = (
        ["model.safetensors"]
        if n == 1
        else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    )
    return [ShardPlan(name, tuple(g), s) for name, g, s in zip(names, groups, sizes, strict=True)]


# ---------------------------------------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------------------------------------

# A tensor is drawn in chunks of this many elements, chunk i from its own generator, so large tensors are
# drawn in parallel (and identically whatever the number of workers). A tensor of at most one chunk is drawn
# from the key's generator alone, as it always was.
_CHUNK = 1 << 22
# How far (in bytes of generated tensors) the parallel generator may run ahead of its consumer; the tensor
# being consumed may exceed it.
_LOOKAHEAD_BYTES = 1 << 30


def _key_seeds(keys: Sequence[str], seed: int) -> dict[str, int]:
    seeds: dict[str, int] = {}
    taken: set[int] = set()
    for key in keys:
        salt = 0
        value = zlib.crc32(f"{seed}/{key}".encode())
        while value in taken:
            salt += 1
            value = zlib.crc32(f"{seed}/{key}/{salt}".encode())
        taken.add(value)
        seeds[key] = value
    return seeds


def generator_seeds(shards: Sequence[ShardPlan], seed: int) -> dict[str, int]:
    """The ``torch.Generator`` seed of every tensor: a stable hash of (seed, key), distinct across keys.

    The CPU generator (mt19937) only uses the low 32 bits of its seed, so the hash is 32-bit crc32 (stable
    across processes, unlike hash()). With ~20k tensors a collision is possible (~4% for qwen3-30b); it
    would give two same-shaped tensors identical values, so colliding keys are re-hashed with a salt.
    Chunk i > 0 of a tensor larger than one chunk uses crc32 of (this seed, i).
    """
    return _key_seeds([t.key for shard in shards for t in shard.tensors], seed)


_scratch = threading.local()


def _fill(spec: TensorSpec, out: torch.Tensor, seed: int, chunk: int) -> None:
    """Draw chunk ``chunk`` of ``spec`` into ``out`` (a flat slice of the tensor, at most one chunk)."""
    g = torch.Generator().manual_seed(seed if chunk == 0 else zlib.crc32(f"{seed}/{chunk}".encode()))
    n = out.numel()
    if out.dtype == torch.float32:
        values = out
    else:  # draw in float32, then round once: a per-thread buffer saves a fresh allocation per chunk
        buffer = getattr(_scratch, "buffer", None)
        if buffer is None or buffer.numel() < n:
            buffer = _scratch.buffer = torch.empty(max(n, _CHUNK), dtype=torch.float32)
        values = buffer[:n]
    if spec.init == "normal" and spec.mean == 0.0 and n >= 16:
        # Bit for bit randn(n) * std (CPU normal_ rounds z * std once, as mul_ does, for 16+ float32
        # elements) without the elementwise passes, each of which starts an intra-op thread team in every
        # drawing thread: on a 16-core host, 16 workers drew 3.1 GB/s of bf16 with them, 3.9 GB/s without.
        values.normal_(0.0, spec.std, generator=g)
    elif spec.init == "normal":
        torch.randn(n, generator=g, dtype=torch.float32, out=values).mul_(spec.std).add_(spec.mean)
    elif spec.init == "log_uniform":
        torch.rand(n, generator=g, dtype=torch.float32, out=values)
        values.mul_(spec.high - spec.low).add_(spec.low).log_()
    else:
        raise ValueError(f"{spec.key}: unknown init {spec.init!r}")
    if values is not out:
        out.copy_(values)


def _start(spec: TensorSpec, seed: int, storage: torch.dtype, submit: Any) -> tuple[torch.Tensor, list[Any]]:
    """Allocate ``spec``'s tensor and ``submit(fn, *args)`` the draws of its chunks; return both."""
    if spec.init == "const":
        return torch.tensor(spec.values, dtype=spec.torch_dtype(storage)).reshape(spec.shape), []
    with torch.inference_mode(False):  # worker threads fill it, outside any caller's inference mode
        out = torch.empty(spec.shape, dtype=spec.torch_dtype(storage))
    flat = out.view(-1)
    jobs = [
        submit(_fill, spec, flat[start : start + _CHUNK], seed, start // _CHUNK)
        for start in range(0, spec.numel, _CHUNK)
    ]
    return out, jobs


def _tensor(spec: TensorSpec, generator_seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Draw ``spec`` in this thread (its own generators: any tensor can be produced alone, reruns agree)."""
    out, _ = _start(spec, generator_seed, dtype, lambda fn, *args: fn(*args))
    return out


def _default_workers() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 32))


def _generate(
    specs: Sequence[TensorSpec], seeds: Mapping[str, int], storage: torch.dtype, workers: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) for ``specs`` in order, the chunks drawn by ``workers`` threads ahead of the consumer."""
    if workers <= 1:
        for spec in specs:
            yield spec.key, _tensor(spec, seeds[spec.key], storage)
        return
    pending: deque[tuple[str, torch.Tensor, list[Future]]] = deque()
    ahead = 0  # bytes allocated for pending tensors
    todo = iter(specs)
    with ThreadPoolExecutor(workers, thread_name_prefix="synthetic") as pool:
        try:
            while True:
                while not pending or ahead < _LOOKAHEAD_BYTES:
                    spec = next(todo, None)
                    if spec is None:
                        break
                    out, jobs = _start(spec, seeds[spec.key], storage, pool.submit)
                    pending.append((spec.key, out, jobs))
                    ahead += out.nbytes
                if not pending:
                    return
                key, out, jobs = pending.popleft()
                for job in jobs:
                    job.result()
                ahead -= out.nbytes
                yield key, out
        finally:  # the consumer stopped early (or a draw failed): drop the work queued for later tensors
            for _, _, jobs in pending:
                for job in jobs:
                    job.cancel()


def synthetic_tensors(
    config: Mapping[str, Any],
    seed: int = 0,
    *,
    workers: int | None = None,
    keep: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF key, tensor) for every tensor of the checkpoint of ``config``, in checkpoint order.

    ``config`` is a config.json dict (``model_config``'s result). Tensors are in their storage dtype (the
    config's torch_dtype; qwen4_exp's n-gram hash buffers are int64) and equal, bit for bit, what
    ``make_model`` writes for the same config and seed. Nothing is written to disk: a caller can build a
    large checkpoint straight in (GPU) memory, holding only what it keeps. Values are drawn by ``workers``
    threads (default: the CPUs available, at most 32) up to ~1 GiB ahead of the consumer; the values do not
    depend on ``workers``. ``keep(key)`` selects tensors (the others are never drawn; values do not change).
    """
    if config["torch_dtype"] not in _STORAGE_DTYPES:
        raise ValueError(f"torch_dtype {config['torch_dtype']!r} not supported")
    specs = plan_tensors(config)
    seeds = _key_seeds([s.key for s in specs], seed)
    if keep is not None:
        specs = [s for s in specs if keep(s.key)]
    storage = _STORAGE_DTYPES[config["torch_dtype"]]
    return _generate(specs, seeds, storage, _default_workers() if workers is None else workers)


# ---------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------


def _save_shard(tensors: Mapping[str, torch.Tensor], out: Path, filename: str) -> None:
    tmp = out / (filename + ".tmp")
    save_file(dict(tensors), tmp, metadata={"format": "pt"})
    os.chmod(tmp, 0o644)  # safetensors creates files owner-only; checkpoints are shared read-only data
    # Rename last so an interrupted run never leaves a plausible-looking but truncated shard.
    os.replace(tmp, out / filename)


def _remove_stale_weights(out: Path) -> None:
    # A previous run with another shard count would leave files the new index does not mention.
    for f in [
        *out.glob("model-*-of-*.safetensors"),
        out / "model.safetensors",
        out / "model.safetensors.index.json",
    ]:
        f.unlink(missing_ok=True)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


# 2-D weights that HF FP8 releases (Qwen3-FP8, DeepSeek-V3) keep in the checkpoint dtype.
_FP8_UNQUANTIZED = ("embed_tokens.weight", "lm_head.weight", ".gate.weight", ".shared_expert_gate.weight")


def _fp8_quantized(key: str, shape: Sequence[int]) -> bool:
    """Whether the FP8 variant stores this tensor block-quantized: every 2-D linear weight (attention, dense
    MLP, experts, shared expert) but the embedding, the head and the routers, as the FP8 releases do."""
    return len(shape) == 2 and key.endswith(".weight") and not key.endswith(_FP8_UNQUANTIZED)


def fp8_quantization_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's quantization_config for the FP8 variant of ``cfg``, as Qwen3-FP8 writes it."""
    skip = [s.key.removesuffix(".weight") for s in plan_tensors(cfg) if s.key.endswith(_FP8_UNQUANTIZED)]
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        "modules_to_not_convert": skip,
    }


def _stored(key: str, tensor: torch.Tensor, quantize: str | None) -> dict[str, torch.Tensor]:
    """The checkpoint tensors for one planned tensor: itself, or (fp8) its fp8 codes and block scale_inv."""
    if quantize is None or not _fp8_quantized(key, tensor.shape):
        return {key: tensor}
    weight, scale_inv = quantize_fp8_block(tensor)
    return {key: weight, f"{key}_scale_inv": scale_inv}


def make_model(
    out: str | Path,
    preset: str = "tiny",
    arch: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    seed: int = 0,
    shard_bytes: int | None = None,
    quantize: str | None = None,
) -> Path:
    """Write a synthetic checkpoint into ``out`` and return it.

    Writes config.json, generation_config.json, the tokenizer, and the weights as safetensors shards
    (plus model.safetensors.index.json when there is more than one). Shards are generated and saved one at
    a time, so peak memory is about one shard (plus ``synthetic_tensors``' lookahead) whatever the model
    size. ``quantize="fp8"`` (flat archs) writes the HF FP8 variant: each linear weight but the embedding,
    head and routers as float8_e4m3fn with a float32 ``weight_scale_inv`` per 128×128 block (edge blocks
    partial), and config.json's ``quantization_config``; the shards keep the unquantized plan's grouping.
    """
    from common.model.synthetic_tokenizer import tokenizer_vocab_size, write_tokenizer

    p, arch = _resolve(preset, arch)
    if quantize not in (None, "fp8") or (quantize and arch not in FLAT_ARCHS):
        raise ValueError(f"quantize={quantize!r} is not supported for {arch} (only 'fp8', for {FLAT_ARCHS})")
    cfg = model_config(preset, arch, overrides)
    if quantize:
        cfg["quantization_config"] = fp8_quantization_config(cfg)
    shards = plan_shards(cfg, shard_bytes or p.shard_bytes)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    vocab = text_config(cfg)["vocab_size"]
    write_tokenizer(out, vocab_size=min(vocab, TOKENIZER_VOCAB))
    if tokenizer_vocab_size(out) > vocab:
        raise ValueError(f"vocab_size {vocab} is smaller than the tokenizer's {tokenizer_vocab_size(out)}")
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", generation_config(cfg))

    _remove_stale_weights(out)
    tensors = synthetic_tensors(cfg, seed)
    weight_map: dict[str, str] = {}
    total = 0
    for n, shard in enumerate(shards, 1):
        log.info("writing %s (%d/%d, %.1f MB)", shard.filename, n, len(shards), shard.nbytes / 1e6)
        batch: dict[str, torch.Tensor] = {}
        for spec in shard.tensors:
            key, tensor = next(tensors)
            assert key == spec.key, (key, spec.key)  # the same plan, in the same order
            batch.update(_stored(key, tensor, quantize))
        _save_shard(batch, out, shard.filename)
        weight_map.update(dict.fromkeys(batch, shard.filename))
        total += sum(t.nbytes for t in batch.values())
        del batch
    tensors.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_json(out / "model.safetensors.index.json", index)
    return out
