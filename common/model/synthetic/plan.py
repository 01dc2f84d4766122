"""What a synthetic checkpoint holds: every tensor's key, shape and how its values are drawn, for each
family, and how the tensors are cut into safetensors shards."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from common.model.ngram import NGramSpec, ngram_shard_rows
from common.model.synthetic.presets import BUFFER_DTYPES, QWEN4_TEXT_PREFIX, STORAGE_DTYPES

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
        return storage if self.dtype is None else BUFFER_DTYPES[self.dtype]


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
    if arch == "glm4_moe" and cfg.get("attention_bias", False):  # o_proj has none in GLM-4.5
        specs += [_bias(f"{p}.{n}_proj.bias", d) for n, d in (("q", q_out), ("k", kv_out), ("v", kv_out))]
    if arch == "qwen3_moe" and cfg.get("attention_bias", False):
        specs += [
            _bias(f"{p}.{n}_proj.bias", d) for n, d in (("q", q_out), ("k", kv_out), ("v", kv_out), ("o", h))
        ]
    if arch == "qwen2_moe" and cfg.get("qkv_bias", True):  # o_proj never has a bias in Qwen2-MoE
        specs += [_bias(f"{p}.{n}_proj.bias", d) for n, d in (("q", q_out), ("k", kv_out), ("v", kv_out))]
    if arch == "qwen3_moe" or (arch == "glm4_moe" and cfg.get("use_qk_norm", False)):
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


def _glm4_mlp(cfg: Mapping[str, Any], i: int, p: str) -> list[TensorSpec]:
    """GLM-4.5: dense SwiGLU layers first, then routed experts (sigmoid router with a correction bias) and
    ungated shared experts."""
    h = cfg["hidden_size"]
    if i < cfg.get("first_k_dense_replace", 1):
        return _swiglu(p, h, cfg["intermediate_size"])
    e, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    specs = [
        _linear(f"{p}.gate.weight", e, h, scale=2.0),
        TensorSpec(f"{p}.gate.e_score_correction_bias", (e,), 0.0, 0.1),
    ]
    for j in range(e):
        specs += _swiglu(f"{p}.experts.{j}", h, inter)
    return specs + _swiglu(f"{p}.shared_experts", h, inter * cfg.get("n_shared_experts", 1))


def _mixtral_moe(cfg: Mapping[str, Any], p: str) -> list[TensorSpec]:
    h, e, inter = cfg["hidden_size"], cfg["num_local_experts"], cfg["intermediate_size"]
    specs = [_linear(f"{p}.gate.weight", e, h, scale=2.0)]
    for j in range(e):
        specs += _swiglu(f"{p}.experts.{j}", h, inter, names=("w1", "w3", "w2"))
    return specs


# --- qwen4_exp --------------------------------------------------------------------------------------------


def _gated_deltanet(t: Mapping[str, Any], p: str, fused: bool = False) -> list[TensorSpec]:
    """A linear_attention layer's Gated DeltaNet: the input projections as qwen4_exp and Qwen3.5 save them
    (q|k|v, z, b, a) or, `fused`, as Qwen3-Next does (``in_proj_qkvz``: per key head q, k, then its value
    heads' v and z; ``in_proj_ba``: per key head its value heads' b, then a; rows are drawn alike, so the
    grouping is the shape's alone)."""
    h = t["hidden_size"]
    key_dim = t["linear_num_key_heads"] * t["linear_key_head_dim"]
    v_heads = t["linear_num_value_heads"]
    value_dim = v_heads * t["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim
    inputs = (
        [
            _linear(f"{p}.in_proj_qkvz.weight", conv_dim + value_dim, h),
            _linear(f"{p}.in_proj_ba.weight", 2 * v_heads, h),
        ]
        if fused
        else [
            _linear(f"{p}.in_proj_qkv.weight", conv_dim, h),
            _linear(f"{p}.in_proj_z.weight", value_dim, h),
            _linear(f"{p}.in_proj_b.weight", v_heads, h),
            _linear(f"{p}.in_proj_a.weight", v_heads, h),
        ]
    )
    return [
        *inputs,
        _conv(f"{p}.conv1d.weight", conv_dim, t.get("linear_conv_kernel_dim", 4)),
        TensorSpec(f"{p}.dt_bias", (v_heads,), 1.0, 0.1),
        # A = exp(A_log) in [0.5, 4): a moderate decay, so the recurrent state carries context.
        TensorSpec(f"{p}.A_log", (v_heads,), 0.0, 0.0, init="log_uniform", low=0.5, high=4.0),
        _norm(f"{p}.norm.weight", t["linear_value_head_dim"]),  # the gated norm multiplies by w, not 1 + w
        _linear(f"{p}.out_proj.weight", h, value_dim),
    ]


def _gated_attention(t: Mapping[str, Any], p: str, hd: int) -> list[TensorSpec]:
    """A full_attention layer's gated attention (q_proj also yields the output gate) and (1 + w) q/k norms."""
    h = t["hidden_size"]
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
    return [*specs, _offset_norm(f"{p}.q_norm.weight", hd), _offset_norm(f"{p}.k_norm.weight", hd)]


def _qsa_attention(t: Mapping[str, Any], p: str) -> list[TensorSpec]:
    """A qwen4_exp full_attention layer: gated attention and its QSA indexer."""
    h, idx_dim = t["hidden_size"], t["indexer_head_dim"]
    return [
        *_gated_attention(t, p, t["head_dim"]),
        _linear(
            f"{p}.indexer.index_qk_proj.weight", (t["indexer_n_heads"] + t["indexer_kv_heads"]) * idx_dim, h
        ),
        _offset_norm(f"{p}.indexer.q_layernorm.weight", idx_dim),
        _offset_norm(f"{p}.indexer.k_layernorm.weight", idx_dim),
    ]


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


def _vision_tower(v: Mapping[str, Any], p: str = "model.visual") -> list[TensorSpec]:
    """The ViT (transformers' Qwen4ExpVisionModel): patch embedding, position table, blocks, merger."""
    d, inner, c = v["hidden_size"], v["intermediate_size"], v.get("in_channels", 3)
    t, ps, m = v["temporal_patch_size"], v["patch_size"], v["spatial_merge_size"]
    patch_in = c * t * ps * ps
    merged = d * m * m
    specs = [
        TensorSpec(f"{p}.patch_embed.proj.weight", (d, c, t, ps, ps), 0.0, patch_in**-0.5),
        _bias(f"{p}.patch_embed.proj.bias", d),
        TensorSpec(f"{p}.pos_embed.weight", (v["num_position_embeddings"], d), 0.0, 0.5),
    ]
    for i in range(v["depth"]):
        b = f"{p}.blocks.{i}"
        specs += [_norm(f"{b}.norm1.weight", d), _bias(f"{b}.norm1.bias", d)]
        specs += [_linear(f"{b}.attn.qkv.weight", 3 * d, d), _bias(f"{b}.attn.qkv.bias", 3 * d)]
        specs += [_linear(f"{b}.attn.proj.weight", d, d), _bias(f"{b}.attn.proj.bias", d)]
        specs += [_norm(f"{b}.norm2.weight", d), _bias(f"{b}.norm2.bias", d)]
        specs += [_linear(f"{b}.mlp.linear_fc1.weight", inner, d), _bias(f"{b}.mlp.linear_fc1.bias", inner)]
        specs += [_linear(f"{b}.mlp.linear_fc2.weight", d, inner), _bias(f"{b}.mlp.linear_fc2.bias", d)]
    specs += [_norm(f"{p}.merger.norm.weight", d), _bias(f"{p}.merger.norm.bias", d)]
    specs += [
        _linear(f"{p}.merger.linear_fc1.weight", merged, merged),
        _bias(f"{p}.merger.linear_fc1.bias", merged),
    ]
    out = v["out_hidden_size"]
    specs += [
        _linear(f"{p}.merger.linear_fc2.weight", out, merged),
        _bias(f"{p}.merger.linear_fc2.bias", out),
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
    return _vision_tower(cfg["vision_config"]) + specs  # module order: the tower comes first


# --- qwen3_next -------------------------------------------------------------------------------------------


def _qwen3_next_layer_types(cfg: Mapping[str, Any]) -> list[str]:
    """``layer_types``, or the release's ``full_attention_interval`` pattern."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    interval = cfg.get("full_attention_interval", 4)
    n = cfg["num_hidden_layers"]
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]


def _plan_qwen3_next(cfg: Mapping[str, Any]) -> list[TensorSpec]:
    """Qwen3-Next as transformers' save_pretrained writes it: one residual stream, (1 + w) RMSNorms, routed
    experts plus a sigmoid-gated shared expert (dense where mlp_only_layers / decoder_sparse_step say)."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    specs = [TensorSpec("model.embed_tokens.weight", (v, h), 0.0, 1.0)]
    for i, kind in enumerate(_qwen3_next_layer_types(cfg)):
        p = f"model.layers.{i}"
        if kind == "linear_attention":
            specs += _gated_deltanet(cfg, f"{p}.linear_attn", fused=True)
        else:
            specs += _gated_attention(cfg, f"{p}.self_attn", _head_dim(cfg))
        if _is_sparse(cfg, i):
            specs += _qwen4_moe(cfg, f"{p}.mlp")
        else:
            specs += _swiglu(f"{p}.mlp", h, cfg["intermediate_size"])
        specs += [
            _offset_norm(f"{p}.input_layernorm.weight", h),
            _offset_norm(f"{p}.post_attention_layernorm.weight", h),
        ]
    specs.append(_offset_norm("model.norm.weight", h))
    if not cfg.get("tie_word_embeddings", False):
        specs.append(_linear("lm_head.weight", v, h, scale=2.0))
    return specs


def plan_tensors(cfg: Mapping[str, Any]) -> list[TensorSpec]:
    """Every tensor of the checkpoint for ``cfg``, in module order, named as the family's HF checkpoints."""
    if cfg["model_type"] == "qwen4_exp":
        return _plan_qwen4(cfg)
    if cfg["model_type"] == "qwen3_next":
        return _plan_qwen3_next(cfg)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    specs = [TensorSpec("model.embed_tokens.weight", (v, h), 0.0, 1.0)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        specs += _attention(cfg, f"{p}.self_attn")
        if cfg["model_type"] == "mixtral":
            specs += _mixtral_moe(cfg, f"{p}.block_sparse_moe")
        elif cfg["model_type"] == "glm4_moe":
            specs += _glm4_mlp(cfg, i, f"{p}.mlp")
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
    storage = STORAGE_DTYPES[cfg["torch_dtype"]]
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
