"""Synthetic MoE checkpoints in the real Hugging Face on-disk format.

No real weights can be downloaded where this project is developed and tested, so this module writes
checkpoints that look exactly like the published ones (config.json in the legacy form, per-expert
tensor names, sharded safetensors with an index, a tokenizer) but hold deterministic random weights.
Four families are supported: ``qwen3_moe``, ``qwen2_moe`` and ``mixtral`` (flat config.json), and
``qwen4_exp`` (Qwen3.8-Flash-Next: a nested multimodal config.json whose text weights live under
``model.language_model.``; hybrid Gated-DeltaNet / QSA-indexed attention, hyper-connections, and a hashed
n-gram per-layer embedding (PLE) whose table is stored in ``split_ngram_parts`` row shards).

``synthetic_tensors`` yields the weights one tensor at a time without touching the disk (what ``make_model``
writes, byte for byte), so a machine with little disk can build a large checkpoint straight in memory.

Weights are chosen so that the model is *informative*: logits have a wide spread and routing is
decisive, so comparing two implementations (ours against transformers) on logits and greedy tokens
is meaningful rather than dominated by near-ties.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

log = logging.getLogger(__name__)

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")

# The synthetic tokenizer's size; the model's vocab may be larger (real checkpoints pad their embeddings).
TOKENIZER_VOCAB = 1024
EOS_TOKEN_ID = 2  # <|im_end|>
PAD_TOKEN_ID = 0  # <|endoftext|>

_ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
_STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Fixed by the arch argument; overriding them would write keys that contradict the config.
_FROZEN_FIELDS = ("model_type", "architectures")


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

PRESETS: dict[str, Preset] = {
    # 256 KiB shards: the tiny model (~0.8 MB in bf16) spans several, which exercises the index.
    "tiny": Preset(configs=_TINY, shard_bytes=256 * 1024),
    # "4GB" as Hugging Face counts it (10**9): ~61 GB of bf16 -> 16 shards, like the published checkpoint.
    "qwen3-30b": Preset(configs={"qwen3_moe": _QWEN3_30B}, shard_bytes=4 * 10**9),
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

    The dict is in the legacy form real checkpoints use (``rope_theta``, ``rope_scaling``,
    ``torch_dtype``) plus ``architectures`` and ``model_type``.
    """
    p, arch = _resolve(preset, arch)
    overrides = dict(overrides or {})
    frozen = sorted(set(overrides) & set(_FROZEN_FIELDS))
    if frozen:
        raise ValueError(f"cannot override {frozen}; pick the family with arch= (one of {list(ARCHS)})")
    cfg: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "torch_dtype": "bfloat16",
        # The synthetic tokenizer has no BOS; generation stops on <|im_end|> (and <|endoftext|>, see
        # generation_config.json).
        "bos_token_id": None,
        "eos_token_id": EOS_TOKEN_ID,
        **json.loads(json.dumps(p.configs[arch])),  # deep copy: callers may mutate the result
        **overrides,
    }
    if cfg["torch_dtype"] not in _STORAGE_DTYPES:
        raise ValueError(
            f"torch_dtype {cfg['torch_dtype']!r} not supported; choose one of {list(_STORAGE_DTYPES)}"
        )
    return cfg


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
    """One checkpoint tensor: its HF key, shape, and the normal distribution its values are drawn from."""

    key: str
    shape: tuple[int, ...]
    mean: float
    std: float

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


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


def plan_tensors(cfg: Mapping[str, Any]) -> list[TensorSpec]:
    """Every tensor of the checkpoint for ``cfg``, in module order, named as the family's HF checkpoints."""
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
    itemsize = _STORAGE_DTYPES[cfg["torch_dtype"]].itemsize
    groups: list[list[TensorSpec]] = [[]]
    sizes = [0]
    for spec in plan_tensors(cfg):
        nbytes = spec.numel * itemsize
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
# Writing
# ---------------------------------------------------------------------------------------------------------


def generator_seeds(shards: Sequence[ShardPlan], seed: int) -> dict[str, int]:
    """The ``torch.Generator`` seed of every tensor: a stable hash of (seed, key), distinct across keys.

    The CPU generator (mt19937) only uses the low 32 bits of its seed, so the hash is 32-bit crc32 (stable
    across processes, unlike hash()). With ~20k tensors a collision is possible (~4% for qwen3-30b); it
    would give two same-shaped tensors identical values, so colliding keys are re-hashed with a salt.
    """
    seeds: dict[str, int] = {}
    taken: set[int] = set()
    for key in (t.key for shard in shards for t in shard.tensors):
        salt = 0
        value = zlib.crc32(f"{seed}/{key}".encode())
        while value in taken:
            salt += 1
            value = zlib.crc32(f"{seed}/{key}/{salt}".encode())
        taken.add(value)
        seeds[key] = value
    return seeds


def _tensor(spec: TensorSpec, generator_seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Draw ``spec`` from its own generator, so any shard can be produced alone and reruns are identical."""
    g = torch.Generator().manual_seed(generator_seed)
    t = torch.randn(spec.shape, generator=g, dtype=torch.float32)
    return t.mul_(spec.std).add_(spec.mean).to(dtype)


def _write_shard(shard: ShardPlan, out: Path, seeds: Mapping[str, int], dtype: torch.dtype) -> None:
    tensors = {s.key: _tensor(s, seeds[s.key], dtype) for s in shard.tensors}
    tmp = out / (shard.filename + ".tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.chmod(tmp, 0o644)  # safetensors creates files owner-only; checkpoints are shared read-only data
    # Rename last so an interrupted run never leaves a plausible-looking but truncated shard.
    os.replace(tmp, out / shard.filename)


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


def make_model(
    out: str | Path,
    preset: str = "tiny",
    arch: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    seed: int = 0,
    shard_bytes: int | None = None,
) -> Path:
    """Write a synthetic checkpoint into ``out`` and return it.

    Writes config.json, generation_config.json, the tokenizer, and the weights as safetensors shards
    (plus model.safetensors.index.json when there is more than one). Shards are generated and saved one at
    a time, so peak memory is about one shard whatever the model size.
    """
    from common.model.synthetic_tokenizer import tokenizer_vocab_size, write_tokenizer

    p, arch = _resolve(preset, arch)
    cfg = model_config(preset, arch, overrides)
    shards = plan_shards(cfg, shard_bytes or p.shard_bytes)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    write_tokenizer(out, vocab_size=min(cfg["vocab_size"], TOKENIZER_VOCAB))
    if tokenizer_vocab_size(out) > cfg["vocab_size"]:
        raise ValueError(
            f"vocab_size {cfg['vocab_size']} is smaller than the tokenizer's {tokenizer_vocab_size(out)}"
        )
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", generation_config(cfg))

    _remove_stale_weights(out)
    dtype = _STORAGE_DTYPES[cfg["torch_dtype"]]
    seeds = generator_seeds(shards, seed)
    for n, shard in enumerate(shards, 1):
        log.info("writing %s (%d/%d, %.1f MB)", shard.filename, n, len(shards), shard.nbytes / 1e6)
        _write_shard(shard, out, seeds, dtype)
    if len(shards) > 1:
        weight_map = {s.key: shard.filename for shard in shards for s in shard.tensors}
        index = {"metadata": {"total_size": sum(s.nbytes for s in shards)}, "weight_map": weight_map}
        _write_json(out / "model.safetensors.index.json", index)
    return out
