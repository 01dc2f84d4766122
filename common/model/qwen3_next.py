"""qwen3_next (Qwen3-Next-80B-A3B) as a Qwen4ExpConfig: qwen4_exp's hybrid with its extras off.

What the two share: Gated DeltaNet layers and gated attention (q/k (1 + w) norms, partial RoPE, output
gate) in the same pattern, a MoE with a sigmoid-gated shared expert, (1 + w) RMSNorms. What qwen3_next
lacks: hyper-connections (one residual stream with pre-norms and a final norm instead:
`hyper_connections=False`), the PLE n-gram module, the QSA indexer (its attention layers are
`full_attention`: every key), vision and M-RoPE. What it adds: dense MLP layers where `mlp_only_layers` or
`decoder_sparse_step` say so, and its own checkpoint layout of the Gated DeltaNet input projections
(`split_gdn_projections`). Its MTP head (another layout than qwen4_exp's) is not loaded.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from common.config import ModelConfig
from common.model.checkpoint import TensorSource, check_shape
from common.model.families import common_fields, qwen_expert_key, qwen_experts, qwen_mlp_types
from common.model.qwen4_exp import build_qwen4
from common.model.qwen4_exp.config import Qwen4ExpConfig
from common.model.registry import Architecture, ExpertKey, register_architecture
from common.model.rope_config import parse_rope

_MIXERS = ("linear_attention", "full_attention")
_GDN_INPUT = re.compile(r"^(model\.layers\.\d+\.linear_attn)\.in_proj_(qkvz|ba)\.weight$")


def parse_qwen3_next(hf: dict[str, Any]) -> Qwen4ExpConfig:
    """HF config.json (transformers 5's spellings, or the release's: `full_attention_interval`, top-level
    `rope_theta` / `partial_rotary_factor`) → Qwen4ExpConfig; defaults are transformers'. ValueError for
    what the runtime cannot run."""
    n = hf["num_hidden_layers"]
    types = tuple(hf.get("layer_types") or _interval_types(n, hf.get("full_attention_interval", 4)))
    _check(hf, types, n)
    experts = qwen_experts(hf, 512)
    fields = common_fields(hf, 1e-6)
    fields.update(
        head_dim=hf.get("head_dim") or 256,  # transformers' default, not hidden_size / heads
        rope=parse_rope({"partial_rotary_factor": 0.25, **hf}),  # 0.25 where neither form names it
    )
    return Qwen4ExpConfig(
        **fields,
        layer_types=types,
        mlp_types=qwen_mlp_types(hf, experts),
        intermediate_size=hf.get("intermediate_size", 5632),
        num_experts=experts,
        top_k=hf.get("num_experts_per_tok", 10),
        moe_intermediate_size=hf.get("moe_intermediate_size", 512),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 512),
        shared_expert_gated=True,
        qkv_bias=bool(hf.get("attention_bias", False)),
        o_bias=bool(hf.get("attention_bias", False)),
        qk_norm=True,
        linear_num_key_heads=hf.get("linear_num_key_heads", 16),
        linear_num_value_heads=hf.get("linear_num_value_heads", 32),
        linear_key_head_dim=hf.get("linear_key_head_dim", 128),
        linear_value_head_dim=hf.get("linear_value_head_dim", 128),
        linear_conv_kernel_dim=hf.get("linear_conv_kernel_dim", 4),
        output_gate_act="silu",  # transformers' Qwen3NextRMSNormGated: SiLU whatever hidden_act
        hyper_connections=False,
        hc_count=1,
    )


def _interval_types(n: int, interval: int) -> list[str]:
    """The release's pattern: every `interval`-th layer full attention, the others linear."""
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]


def _check(hf: dict[str, Any], types: tuple[str, ...], n: int) -> None:
    """What the runtime's modules assume of a qwen3_next config (errors name its model_type)."""
    family = hf.get("model_type", "qwen3_next")
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers={n}")
    unknown = sorted(set(types) - set(_MIXERS))
    if unknown:
        raise ValueError(f"unsupported {family} layer_types {unknown} (supported: {list(_MIXERS)})")
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers' GDN conv takes hidden_act; ours is SiLU's
        raise ValueError(f"hidden_act {act!r} is not supported for {family} (supported: silu)")
    k_heads, v_heads = hf.get("linear_num_key_heads", 16), hf.get("linear_num_value_heads", 32)
    if v_heads % k_heads:
        raise ValueError(
            f"linear_num_value_heads {v_heads} is not a multiple of linear_num_key_heads {k_heads}"
        )


def map_qwen3_next_key(key: str, cfg: ModelConfig) -> str | ExpertKey | None:
    """Checkpoint key (`split_gdn_projections`' names) → runtime name: routed experts as Qwen's, the MTP
    head left out, everything else by its own name."""
    if key.startswith("mtp."):
        return None
    return qwen_expert_key(key)


def split_gdn_projections(source: TensorSource, cfg: ModelConfig) -> Iterator[tuple[Path, str, Callable]]:
    """`source` with each Gated DeltaNet's `in_proj_qkvz` and `in_proj_ba` (rows grouped by key head: q, k,
    then its value heads' v and z; its value heads' b, then a) as the runtime's `in_proj_qkv` (every q, every
    k, every v), `in_proj_z`, `in_proj_b` and `in_proj_a`; every other tensor as it is. Each part's reader
    reads the fused tensor once for all its parts (while any of them is unread)."""
    assert isinstance(cfg, Qwen4ExpConfig)  # parse_qwen3_next's
    for path, key, read in source:
        m = _GDN_INPUT.match(key)
        if m is None:
            yield path, key, read
            continue
        whole = functools.cache(functools.partial(_grouped_parts, read, m[2], cfg, path, key))
        names = ("qkv", "z") if m[2] == "qkvz" else ("b", "a")
        for i, name in enumerate(names):
            yield path, f"{m[1]}.in_proj_{name}.weight", functools.partial(_part, whole, i)


def _part(parts: Callable[[], tuple[torch.Tensor, ...]], i: int) -> torch.Tensor:
    return parts()[i]


def _grouped_parts(
    read: Callable[[], torch.Tensor], kind: str, cfg: Qwen4ExpConfig, path: Path, key: str
) -> tuple[torch.Tensor, ...]:
    """(qkv, z) of an `in_proj_qkvz` weight, or (b, a) of an `in_proj_ba` one; CheckpointError naming
    `path` and `key` for a weight of another shape."""
    hk, r = cfg.linear_num_key_heads, cfg.linear_num_value_heads // cfg.linear_num_key_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    widths = [dk, dk, r * dv, r * dv] if kind == "qkvz" else [r, r]
    weight = read()
    check_shape(weight, (hk * sum(widths), cfg.hidden_size), path, key)
    parts = [p.flatten(0, 1) for p in weight.unflatten(0, (hk, -1)).split(widths, dim=1)]
    if kind == "qkvz":
        q, k, v, z = parts
        return torch.cat([q, k, v]), z.contiguous()
    return tuple(p.contiguous() for p in parts)


register_architecture(
    Architecture("qwen3_next", parse_qwen3_next, build_qwen4, map_qwen3_next_key, split_gdn_projections)
)
