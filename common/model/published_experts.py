"""Routed experts read in a published format's own bits (nvfp4, mxfp4: common/experts/fp4_formats.py).

A checkpoint names each expert tensor by its linear and a suffix: NVFP4 (ModelOpt) per expert,
`<linear>.weight` uint8 [out, in/2], `.weight_scale` e4m3 [out, in/16], `.weight_scale_2` and `.input_scale`
fp32 scalars; MXFP4 (gpt-oss) fused per layer, `<param>_blocks` uint8 [E, out, in/32, 16] and `_scales`
uint8 [E, out, in/32]. The architecture's own key map (`map_key` of the unquantized name) says which expert
and part each is; gate and up rows concatenate into gate_up (gate first, qwen3_moe's order). Every tensor's
dtype and shape is checked, an error naming its file and key.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import torch
from torch import nn

from common.config import ModelConfig
from common.model.checkpoint import TensorSource
from common.model.errors import CheckpointError
from common.model.fp4_blocks import DEQUANTIZE_EXPERTS, MXFP4_GROUP, NVFP4_GROUP
from common.model.provider import ExpertWeights
from common.model.registry import Architecture, ExpertKey
from common.model.resident import ResidentExperts

_SUFFIXES = {
    "nvfp4": {
        ".weight_scale_2": ("weight_scale_2", ".weight", torch.float32),
        ".input_scale": ("input_scale", ".weight", torch.float32),
        ".weight_scale": ("weight_scale", ".weight", torch.float8_e4m3fn),
        ".weight": ("weight", ".weight", torch.uint8),
    },
    "mxfp4": {
        "_blocks": ("blocks", "", torch.uint8),
        "_scales": ("scales", "", torch.uint8),
    },
}
"""Per format: key suffix -> (component name, what replaces the suffix in the unquantized key, dtype)."""

Parts = dict[str, torch.Tensor]
"""Component name -> [E, *shape] tensor (one layer's experts, as the format's `components` name them)."""


def _dims(cfg: ModelConfig, part: str) -> tuple[int, int]:
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    return {"gate": (i, h), "up": (i, h), "gate_up": (2 * i, h), "down": (h, i)}[part]


def _shape(name: str, cfg: ModelConfig, ek: ExpertKey) -> tuple[int, ...]:
    """The published shape of one tensor: per expert, or with a leading expert dim when fused."""
    out, inp = _dims(cfg, ek.part)
    shape: tuple[int, ...] = {
        "weight": (out, inp // 2),
        "weight_scale": (out, inp // 16),
        "weight_scale_2": (),
        "input_scale": (),
        "blocks": (out, inp // 32, 16),
        "scales": (out, inp // 32),
    }[name]
    return shape if ek.expert is not None else (cfg.num_experts, *shape)


class PublishedExperts:
    """Takes a published format's expert tensors out of a checkpoint's stream and assembles, per MoE layer,
    the format's components [E, ...] in their stored bits."""

    prefix = "model."
    """What precedes `layers.` in the checkpoint's expert keys (qwen4_exp: `model.language_model.`)."""

    def __init__(self, fmt: str, arch: Architecture, cfg: ModelConfig, config_path: Path) -> None:
        self.fmt, self.arch, self.cfg = fmt, arch, cfg
        group = {"nvfp4": NVFP4_GROUP, "mxfp4": MXFP4_GROUP}[fmt]
        for field, size in (
            ("hidden_size", cfg.hidden_size),
            ("moe_intermediate_size", cfg.moe_intermediate_size),
        ):
            if size % group:
                raise CheckpointError(f"{fmt} needs a multiple of {group}, got {size}", config_path, field)
        self.found: dict[int, dict[tuple[int | None, str, str], torch.Tensor]] = defaultdict(dict)

    def match(self, key: str) -> tuple[ExpertKey, str, torch.dtype] | None:
        """(expert, component suffix, dtype) of an expert tensor of this format, else None."""
        for suffix, (name, plain, dtype) in _SUFFIXES[self.fmt].items():
            if key.endswith(suffix):
                target = self.arch.map_key(key.removesuffix(suffix) + plain, self.cfg)
                return (target, name, dtype) if isinstance(target, ExpertKey) else None
        return None

    def filter(self, source: TensorSource) -> Iterator[tuple[Path, str, Callable[[], torch.Tensor]]]:
        """`source` without this format's expert tensors, which are read, checked and kept."""
        for path, key, read in source:
            found = self.match(key)
            if found is None:
                yield path, key, read
                continue
            ek, name, dtype = found
            self.prefix = key[: key.index("layers.")]
            try:
                tensor = read()
            except Exception as exc:
                raise CheckpointError(f"cannot read tensor: {exc}", path, key) from exc
            self._add(ek, name, dtype, tensor, path, key)

    def _add(self, ek: ExpertKey, name: str, dtype: torch.dtype, tensor: torch.Tensor, path: Path, key: str):
        cfg = self.cfg
        if ek.layer not in cfg.moe_layers or (ek.expert is not None and ek.expert >= cfg.num_experts):
            raise CheckpointError("expert weight for a layer or expert the config does not have", path, key)
        if tensor.dtype != dtype:
            raise CheckpointError(f"{self.fmt} {name} has dtype {tensor.dtype}, expected {dtype}", path, key)
        want = _shape(name, cfg, ek)
        if tuple(tensor.shape) != want and not (want == () and tuple(tensor.shape) == (1,)):
            raise CheckpointError(f"tensor has shape {list(tensor.shape)}, expected {list(want)}", path, key)
        if (ek.expert, ek.part, name) in self.found[ek.layer]:
            raise CheckpointError("tensor appears twice in the checkpoint", path, key)
        self.found[ek.layer][(ek.expert, ek.part, name)] = tensor.reshape(want)

    def layers(self, where: Path) -> dict[int, Parts]:
        """MoE layer -> its experts' components [E, ...]; CheckpointError naming a missing tensor."""
        names = [name for name, _, _ in _SUFFIXES[self.fmt].values()]
        comps = [f"{part}_{name}" for part in ("gate_up", "down") for name in names]
        out: dict[int, Parts] = {}
        for layer in self.cfg.moe_layers:
            found = self.found.pop(layer, {})
            out[layer] = {c: self._component(found, layer, c, where) for c in comps}
        return out

    def _component(self, found: dict, layer: int, comp: str, where: Path) -> torch.Tensor:
        """One component of a layer's experts [E, ...], from fused or per-expert tensors."""
        part = "gate_up" if comp.startswith("gate_up") else "down"
        name = comp.removeprefix(part + "_")
        if (None, part, name) in found:
            return found[(None, part, name)]
        experts = []
        for e in range(self.cfg.num_experts):
            pieces = []
            for piece in ("gate", "up") if part == "gate_up" else ("down",):
                if (e, piece, name) not in found:
                    raise CheckpointError("missing tensor", where, self._missing_key(layer, e, piece, name))
                pieces.append(found[(e, piece, name)])
            experts.append(torch.cat([p.reshape(-1) if p.dim() == 0 else p for p in pieces]))
        return torch.stack(experts)

    def dequantize(self, parts: Parts, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's components -> (gate_up [E, 2I, H], down [E, H, I]) in dtype, as the expert format
        dequantises them."""
        gate_up, down = DEQUANTIZE_EXPERTS[self.fmt](parts, dtype)
        return gate_up, down

    def _missing_key(self, layer: int, expert: int, piece: str, name: str) -> str:
        suffix = next(s for s, (n, _, _) in _SUFFIXES[self.fmt].items() if n == name)
        if self.fmt == "mxfp4":  # published fused, a layer at a time
            fused = "gate_up" if piece in ("gate", "up") else "down"
            return f"{self.prefix}layers.{layer}.mlp.experts.{fused}_proj{suffix}"
        return f"{self.prefix}layers.{layer}.mlp.experts.{expert}.{piece}_proj{suffix}"


def attach_published(
    model: nn.Module,
    published: PublishedExperts,
    where: Path,
    dtype: torch.dtype,
    device: torch.device | str | None,
) -> None:
    """Give `model` the checkpoint's experts in their published bits (`ResidentExperts.published`) and,
    unless `device` is None, dequantised by their format to `dtype` on `device` as its resident weights."""
    experts = cast(ResidentExperts, model.experts)
    layers = published.layers(where)
    for layer, parts in layers.items():
        if device is None:
            continue
        gate_up, down = published.dequantize(parts, dtype)
        experts.weights[layer] = ExpertWeights(gate_up.to(device), down.to(device))
    experts.published = (published.fmt, layers)
