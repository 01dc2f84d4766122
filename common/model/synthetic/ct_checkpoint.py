"""The compressed-tensors variants of a synthetic checkpoint, written as llm-compressor's `oneshot` with a
QuantizationModifier (scheme W4A16, W4A16_ASYM or NVFP4A16, targets "Linear", ignore lm_head and the
routers) saves them.

Each linear weight but the ignored ones (lm_head, every MoE layer's router and qwen2_moe's shared-expert
gate; the embedding is no linear) becomes, quantised as llm-compressor's round to nearest does
(common/model/ct_blocks.py):
- w4a16 / w4a16-asym: `X.weight_packed`, `X.weight_scale`, `X.weight_shape` and (asymmetric)
  `X.weight_zero_point`. The group is 128 where every quantized linear's input dim is a multiple of it,
  else the largest of 64 and 32 that fits (the tiny preset's: 32).
- nvfp4a16: `X.weight_packed`, `X.weight_scale`, `X.weight_global_scale`; the linears llm-compressor fuses
  (a module's q/k/v, gate/up, w1/w3) share a global scale, of all of them.
config.json's `quantization_config` is what compressed-tensors' `ModelCompressor` writes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from common.model.ct_blocks import ct_nvfp4_global_scale, quantize_ct_nvfp4, quantize_w4a16
from common.model.ct_experts import W4A16_GROUPS
from common.model.synthetic.plan import plan_tensors
from common.model.synthetic.quantized_linears import converted

CT_QUANTIZE = ("w4a16", "w4a16-asym", "nvfp4a16")
CT_VERSION = "0.19.0"
"""The compressed-tensors version whose layout the writer follows (llm-compressor 0.14's)."""
_FUSED = (("gate_proj", "up_proj"), ("q_proj", "k_proj", "v_proj"), ("w1", "w3"))
"""Sibling linears whose NVFP4 global scale llm-compressor fuses (its FUSED_LAYER_NAMES)."""
_NVFP4_WEIGHTS: dict[str, Any] = {
    "actorder": None,
    "block_structure": None,
    "dynamic": False,
    "group_size": 16,
    "num_bits": 4,
    "observer": "memoryless_minmax",
    "observer_kwargs": {},
    "scale_dtype": "torch.float8_e4m3fn",
    "strategy": "tensor_group",
    "symmetric": True,
    "type": "float",
    "zp_dtype": None,
}


def _linear(key: str, shape: tuple[int, ...]) -> bool:
    """Whether the planned tensor is a Linear's weight (not an embedding table)."""
    embedding = key.endswith(("embed_tokens.weight", "pos_embed.weight")) or ".ngram_embedding." in key
    return len(shape) == 2 and key.endswith(".weight") and not embedding


def ct_group(cfg: Mapping[str, Any]) -> int:
    """The group size for `cfg`: the largest of 128, 64, 32 that divides every quantized input dim."""
    dims = {s.shape[-1] for s in plan_tensors(cfg) if converted(cfg, s.key, tuple(s.shape))}
    for group in sorted(W4A16_GROUPS, reverse=True):
        if all(d % group == 0 for d in dims):
            return group
    raise ValueError(f"no W4A16 group size of {W4A16_GROUPS} divides the input dims {sorted(dims)}")


def ct_quantization(cfg: Mapping[str, Any], quantize: str) -> dict[str, Any]:
    """config.json's quantization_config for the `quantize` variant of `cfg`."""
    symmetric = quantize != "w4a16-asym"
    fmt = "nvfp4-pack-quantized" if quantize == "nvfp4a16" else "pack-quantized"
    weights: dict[str, Any] = {
        "actorder": None,
        "block_structure": None,
        "dynamic": False,
        "group_size": ct_group(cfg) if quantize != "nvfp4a16" else 16,
        "num_bits": 4,
        "observer": "memoryless_minmax",
        "observer_kwargs": {},
        "scale_dtype": None,
        "strategy": "group",
        "symmetric": symmetric,
        "type": "int",
        "zp_dtype": None if symmetric else "torch.int8",
    }
    group = {
        "format": fmt,
        "input_activations": None,
        "output_activations": None,
        "targets": ["Linear"],
        "weights": _NVFP4_WEIGHTS if quantize == "nvfp4a16" else weights,
    }
    kept = [
        s.key.removesuffix(".weight")
        for s in plan_tensors(cfg)
        if _linear(s.key, tuple(s.shape)) and not converted(cfg, s.key, tuple(s.shape))
    ]
    return {
        "config_groups": {"group_0": group},
        "format": fmt,
        "global_compression_ratio": None,
        "ignore": [k for k in kept if k != "lm_head"] + ["lm_head"],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": CT_VERSION,
    }


def _fused_with(key: str, planned: set[str]) -> tuple[str, ...]:
    """The planned weights whose NVFP4 global scale `key`'s is (itself, or its fused siblings')."""
    parent, _, name = key.removesuffix(".weight").rpartition(".")
    for group in _FUSED:
        members = tuple(f"{parent}.{n}.weight" for n in group)
        if name in group and all(m in planned for m in members):
            return members
    return (key,)


class CtWriter:
    """Turns a checkpoint's planned tensors, one at a time, into those the `quantize` variant stores (an
    NVFP4 linear's once its fused siblings have come too)."""

    def __init__(self, cfg: Mapping[str, Any], quantize: str) -> None:
        if quantize not in CT_QUANTIZE:
            raise ValueError(f"unknown compressed-tensors variant {quantize!r}")
        self.quantize = quantize
        self.group = ct_group(cfg) if quantize != "nvfp4a16" else 16
        self.symmetric = quantize != "w4a16-asym"
        self.cfg = cfg
        self.planned = {s.key for s in plan_tensors(cfg) if converted(cfg, s.key, tuple(s.shape))}
        self.pending: dict[str, torch.Tensor] = {}

    def stored(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors to store for the planned `key` (nvfp4a16: none until its fused siblings arrive)."""
        if not converted(self.cfg, key, tuple(tensor.shape)):
            return {key: tensor}
        if self.quantize == "nvfp4a16":
            return self._nvfp4(key, tensor)
        module = key.removesuffix(".weight")
        packed, scale, zero = quantize_w4a16(tensor, self.group, self.symmetric)
        out = {
            f"{module}.weight_packed": packed,
            f"{module}.weight_scale": scale,
            f"{module}.weight_shape": torch.tensor(list(tensor.shape), dtype=torch.int64),
        }
        if zero is not None:
            out[f"{module}.weight_zero_point"] = zero
        return out

    def _nvfp4(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        self.pending[key] = tensor
        members = _fused_with(key, self.planned)
        if not all(m in self.pending for m in members):
            return {}
        weights = [self.pending.pop(m) for m in members]
        shared = ct_nvfp4_global_scale(torch.stack([w.abs().amax() for w in weights]).amax())
        out: dict[str, torch.Tensor] = {}
        for member, w in zip(members, weights, strict=True):
            module = member.removesuffix(".weight")
            packed, scale, glob = quantize_ct_nvfp4(w, shared)
            out |= {f"{module}.weight_packed": packed, f"{module}.weight_scale": scale}
            out[f"{module}.weight_global_scale"] = glob.clone()  # one tensor a key: safetensors shares none
        return out
