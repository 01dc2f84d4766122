"""Routed experts in compressed-tensors' own bits (common/model/ct_blocks.py): what each published format
stores per expert, packs and dequantises. The expert formats (common/experts/formats.py) serve them as
they are; the loader (ct_source.py) reads them.

An expert's gate and up linears are stored one after the other along the output dim (gate first), down
alone; zero points are packed along that dim, so gate's and up's concatenate as they are (I % 8 == 0).

- "ct-w4a16[-asym][-gN][-fp16]" (pack-quantized W4A16): `{gate_up,down}_weight_packed` int32 [out, in/8],
  `_weight_scale` [out, in/N] in bf16 (or fp16), and (asym) `_weight_zero_point` int32 [out/8, in/N];
  group N 128 unless named (32, 64).
- "ct-nvfp4" / "ct-nvfp4a16" (nvfp4-pack-quantized, with or without static activation scales):
  `_weight_packed` uint8 [out, in/2], `_weight_scale` e4m3 [out, in/16], `_weight_global_scale` fp32
  [t] (gate's and up's: t = 2; down's: 1) and (ct-nvfp4) `_input_global_scale` fp32 [t].
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from common.model.ct_blocks import (
    PER_WORD,
    ct_nvfp4_global_scale,
    dequantize_ct_nvfp4,
    dequantize_w4a16,
    quantize_ct_nvfp4,
    quantize_w4a16,
)
from common.model.fp4_blocks import NVFP4_GROUP

Components = dict[str, tuple[tuple[int, ...], torch.dtype]]

W4A16_GROUPS = (32, 64, 128)
SCALE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""The scale dtypes a W4A16 checkpoint may store (the model's dtype), by their name suffix."""


def _dims(hidden: int, inter: int) -> tuple[tuple[str, int, int], ...]:
    """(component prefix, out, in) of an expert's two stored weights."""
    return (("gate_up", 2 * inter, hidden), ("down", hidden, inter))


def _split(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[int, int]:
    hidden, inter = down.shape
    if gate_up.dim() != 2 or tuple(gate_up.shape) != (2 * inter, hidden):
        raise ValueError(f"gate_up {tuple(gate_up.shape)} does not match down {tuple(down.shape)}")
    return hidden, inter


@dataclass(frozen=True)
class CtW4A16:
    """pack-quantized W4A16 experts: int4 codes in int32 words, a scale per `group` inputs, and zero points
    unless `symmetric`."""

    group: int = 128
    symmetric: bool = True
    scale_dtype: torch.dtype = torch.bfloat16

    @property
    def name(self) -> str:
        dtype = next(k for k, v in SCALE_DTYPES.items() if v == self.scale_dtype)
        return (
            "ct-w4a16"
            + ("" if self.symmetric else "-asym")
            + ("" if self.group == 128 else f"-g{self.group}")
            + ("" if dtype == "bf16" else f"-{dtype}")
        )

    @property
    def tensors(self) -> dict[str, torch.dtype]:
        """A linear's stored tensors (key suffix after the module name, without the dot) -> dtype."""
        names = {"weight_packed": torch.int32, "weight_scale": self.scale_dtype}
        return names if self.symmetric else {**names, "weight_zero_point": torch.int32}

    def tensor_shape(self, name: str, out: int, inp: int) -> tuple[int, ...]:
        """The shape of one linear's stored tensor `name`."""
        return {
            "weight_packed": (out, inp // PER_WORD),
            "weight_scale": (out, inp // self.group),
            "weight_zero_point": (-(-out // PER_WORD), inp // self.group),
        }[name]

    def components(self, hidden: int, inter: int) -> Components:
        if hidden % self.group or inter % self.group:
            raise ValueError(
                f"{self.name} needs hidden and intermediate sizes that are multiples of {self.group}, "
                f"got hidden={hidden}, inter={inter}"
            )
        return {
            f"{key}_{name}": (self.tensor_shape(name, out, inp), dtype)
            for key, out, inp in _dims(hidden, inter)
            for name, dtype in self.tensors.items()
        }

    def pack(self, gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
        """Quantised as llm-compressor quantises a model of the scale dtype (the weights cast to it first)."""
        hidden, inter = _split(gate_up, down)
        self.components(hidden, inter)  # the dim check
        parts: dict[str, torch.Tensor] = {}
        for key, w in (("gate_up", gate_up), ("down", down)):
            packed, scale, zero = quantize_w4a16(w.to(self.scale_dtype), self.group, self.symmetric)
            parts[f"{key}_weight_packed"], parts[f"{key}_weight_scale"] = packed, scale
            if zero is not None:
                parts[f"{key}_weight_zero_point"] = zero
        return parts

    def unpack_many(
        self, parts: Mapping[str, torch.Tensor], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = [
            dequantize_w4a16(
                parts[f"{key}_weight_packed"],
                parts[f"{key}_weight_scale"],
                parts.get(f"{key}_weight_zero_point"),
                dtype,
            )
            for key in ("gate_up", "down")
        ]
        return out[0], out[1]  # [N, 2I, H], [N, H, I]

    def error_bound(self) -> float:
        # Round-to-nearest over a group's range (its max clipped by half a step when symmetric): ~10-11 %
        # rms on Gaussian weights with groups of 128, less with smaller groups; bound with margin.
        return 0.13


@dataclass(frozen=True)
class CtNvfp4:
    """nvfp4-pack-quantized experts: e2m1 codes, e4m3 block scales and a global scale per linear, and the
    activations' global scale per linear when `input_scale` (W4A4 checkpoints; kept, unused by weight-only
    compute)."""

    input_scale: bool = True

    @property
    def name(self) -> str:
        return "ct-nvfp4" if self.input_scale else "ct-nvfp4a16"

    @property
    def tensors(self) -> dict[str, torch.dtype]:
        names = {
            "weight_packed": torch.uint8,
            "weight_scale": torch.float8_e4m3fn,
            "weight_global_scale": torch.float32,
        }
        return {**names, "input_global_scale": torch.float32} if self.input_scale else names

    def tensor_shape(self, name: str, out: int, inp: int) -> tuple[int, ...]:
        return {
            "weight_packed": (out, inp // 2),
            "weight_scale": (out, inp // NVFP4_GROUP),
            "weight_global_scale": (1,),
            "input_global_scale": (1,),
        }[name]

    def components(self, hidden: int, inter: int) -> Components:
        if hidden % NVFP4_GROUP or inter % NVFP4_GROUP:
            raise ValueError(f"{self.name} needs hidden and intermediate sizes that are multiples of 16")
        comps: Components = {}
        for key, out, inp in _dims(hidden, inter):
            linears = 2 if key == "gate_up" else 1  # a global scale per stored linear
            for name, dtype in self.tensors.items():
                shape = self.tensor_shape(name, out, inp)
                comps[f"{key}_{name}"] = ((linears,) if shape == (1,) else shape, dtype)
        return comps

    def pack(self, gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
        """Gate and up share a global scale (of both), as llm-compressor fuses them; input scales 1 (no
        activations calibrated)."""
        hidden, inter = _split(gate_up, down)
        self.components(hidden, inter)  # the dim check
        parts: dict[str, torch.Tensor] = {}
        for key, ws in (("gate_up", gate_up.split(inter)), ("down", (down,))):
            shared = ct_nvfp4_global_scale(torch.stack([w.abs().amax() for w in ws]).amax())
            packed = [quantize_ct_nvfp4(w, shared) for w in ws]
            parts[f"{key}_weight_packed"] = torch.cat([p[0] for p in packed])
            parts[f"{key}_weight_scale"] = torch.cat([p[1] for p in packed])
            parts[f"{key}_weight_global_scale"] = torch.cat([p[2] for p in packed]).to(gate_up.device)
            if self.input_scale:
                parts[f"{key}_input_global_scale"] = torch.ones(len(ws), device=gate_up.device)
        return parts

    def unpack_many(
        self, parts: Mapping[str, torch.Tensor], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for key in ("gate_up", "down"):
            packed, scale = parts[f"{key}_weight_packed"], parts[f"{key}_weight_scale"]
            glob = parts[f"{key}_weight_global_scale"]  # [N, t]: each stored linear's rows take its own
            rows = glob.repeat_interleave(packed.shape[-2] // glob.shape[-1], dim=-1)  # [N, out]
            out.append(dequantize_ct_nvfp4(packed, scale, rows, dtype))
        return out[0], out[1]  # [N, 2I, H], [N, H, I]

    def error_bound(self) -> float:
        # 1 + 3 bits per element with an e4m3 block scale: ~9 % rms on Gaussian weights, bound with margin.
        return 0.13


CtExpertFormat = CtW4A16 | CtNvfp4

_FORMATS: list[CtExpertFormat] = [
    CtW4A16(group, symmetric, dtype)
    for dtype in SCALE_DTYPES.values()
    for symmetric in (True, False)
    for group in W4A16_GROUPS
]
CT_EXPERT_FORMATS: dict[str, CtExpertFormat] = {f.name: f for f in (*_FORMATS, CtNvfp4(True), CtNvfp4(False))}
"""Every compressed-tensors expert format, by name."""
