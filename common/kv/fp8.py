"""FP8 (e4m3) KV cache: which state it applies to, and the per-layer scaled quantization of keys and values.

Attention K/V pages may be stored as `torch.float8_e4m3fn` (half the bytes of bf16). Each layer has one
fixed scale for K and one for V (`StatePool.kv_scales`), set once at load and never updated from the
traffic, so a request's output does not depend on what else runs with it or what ran before. Only the
specs `kv_specs` marks (`PagedSpec.kv`) take the KV dtype: indexer keys, recurrent and conv states stay in
the model dtype (they are small, and the indexer's top-k and the recurrences are sensitive to rounding).
"""

from __future__ import annotations

import dataclasses

import torch

from common.kv.state import PagedSpec, StateSpec

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
"""Largest finite e4m3fn magnitude: quantized values are clamped to ±FP8_MAX."""
KV_DTYPES = {"auto": None, "fp8_e4m3": FP8, "fp8": FP8}


def parse_kv_dtype(kv_dtype: str | torch.dtype | None) -> torch.dtype | None:
    """`auto`/None (the model dtype), `fp8_e4m3`, or a torch dtype as it is."""
    if kv_dtype is None or isinstance(kv_dtype, torch.dtype):
        return kv_dtype
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {sorted(KV_DTYPES)}, not {kv_dtype!r}")
    return KV_DTYPES[kv_dtype]


def with_kv_dtype(
    layer_specs: list[dict[str, StateSpec]], kv_dtype: torch.dtype | None
) -> list[dict[str, StateSpec]]:
    """`layer_specs` with every K/V spec (`PagedSpec.kv`) stored as `kv_dtype` (None: as they are)."""
    if kv_dtype is None:
        return layer_specs
    return [
        {
            name: dataclasses.replace(s, dtype=kv_dtype) if isinstance(s, PagedSpec) and s.kv else s
            for name, s in specs.items()
        }
        for specs in layer_specs
    ]


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale, clamped to the e4m3 range (saturate rather than overflow to NaN), as float8_e4m3fn."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale).to(dtype)


def scales_from_amax(amax: torch.Tensor, margin: float) -> torch.Tensor:
    """Scales that map `amax × margin` to FP8_MAX (1 where a layer saw only zeros)."""
    return torch.where(amax > 0, amax.float() * margin / FP8_MAX, torch.ones_like(amax, dtype=torch.float32))
