"""Routed experts of a GPTQ or AWQ checkpoint read in their published int32 words (int4_blocks.py).

Each expert linear `<linear>.qweight`, `.qzeros`, `.scales` (and GPTQ's `.g_idx`), its dtype and shape
checked against the config's dims (an error naming its file and key); an expert's gate and up join along the
outputs into the format's gate_up components (int4_blocks.expert_components), so a host store takes them as
they are. GPTQ's g_idx must name groups that exist (checked when read).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

from common.config import ModelConfig
from common.model.errors import CheckpointError
from common.model.int4_blocks import (
    dequantize_experts,
    join_pieces,
    linear_names,
    linear_shapes,
    num_groups,
    parse_int4_format_name,
)
from common.model.published_experts import Parts, PublishedExperts
from common.model.registry import Architecture, ExpertKey


class Int4PublishedExperts(PublishedExperts):
    """`PublishedExperts` for a GPTQ / AWQ expert format (`fmt`: its name, e.g. "gptq-g32")."""

    def __init__(self, fmt: str, arch: Architecture, cfg: ModelConfig, config_path: Path) -> None:
        # (PublishedExperts.__init__ checks FP4 block sizes: these formats check their own dims instead)
        parsed = parse_int4_format_name(fmt)
        if parsed is None:
            raise ValueError(f"{fmt!r} is not a GPTQ or AWQ format")
        self.fmt, self.arch, self.cfg = fmt, arch, cfg
        self.method, self.group = parsed
        for field, size in (
            ("hidden_size", cfg.hidden_size),
            ("moe_intermediate_size", cfg.moe_intermediate_size),
        ):
            try:
                linear_shapes(self.method, self.group, 8, size)
            except ValueError as exc:
                raise CheckpointError(f"{fmt} experts: {exc}", config_path, field) from None
        self.names = linear_names(self.method)
        self.found: dict[int, dict[tuple[int | None, str, str], torch.Tensor]] = defaultdict(dict)

    def match(self, key: str) -> tuple[ExpertKey, str, torch.dtype] | None:
        module, _, name = key.rpartition(".")
        if name not in self.names:
            return None
        target = self.arch.map_key(module + ".weight", self.cfg)
        if not isinstance(target, ExpertKey):
            return None
        return target, name, torch.int32 if name != "scales" else torch.float16

    def _add(self, ek: ExpertKey, name: str, dtype: torch.dtype, tensor: torch.Tensor, path: Path, key: str):
        cfg = self.cfg
        if ek.expert is None:
            raise CheckpointError(f"{self.fmt} experts are published per expert, not fused", path, key)
        if ek.layer not in cfg.moe_layers or ek.expert >= cfg.num_experts:
            raise CheckpointError("expert weight for a layer or expert the config does not have", path, key)
        if tensor.dtype != dtype:
            raise CheckpointError(f"{self.fmt} {name} has dtype {tensor.dtype}, expected {dtype}", path, key)
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        out, inp = (h, i) if ek.part == "down" else (i, h)
        want = linear_shapes(self.method, self.group, out, inp)[name][0]
        if tuple(tensor.shape) != want:
            raise CheckpointError(f"tensor has shape {list(tensor.shape)}, expected {list(want)}", path, key)
        if name == "g_idx" and not tensor.is_meta:
            groups = num_groups(inp, self.group)
            if tensor.numel() and not (int(tensor.min()) >= 0 and int(tensor.max()) < groups):
                raise CheckpointError(f"g_idx names a group outside 0..{groups - 1}", path, key)
        if (ek.expert, ek.part, name) in self.found[ek.layer]:
            raise CheckpointError("tensor appears twice in the checkpoint", path, key)
        self.found[ek.layer][(ek.expert, ek.part, name)] = tensor

    def layers(self, where: Path) -> dict[int, Parts]:
        out: dict[int, Parts] = {}
        for layer in self.cfg.moe_layers:
            found = self.found.pop(layer, {})
            out[layer] = {
                f"{part}_{name}": self._joined(found, layer, part, name, where)
                for part in ("gate_up", "down")
                for name in self.names
            }
        return out

    def _joined(self, found: dict, layer: int, part: str, name: str, where: Path) -> torch.Tensor:
        """One component of a layer's experts [E, ...]: each expert's linears joined (int4_blocks)."""
        experts = []
        for e in range(self.cfg.num_experts):
            pieces = []
            for piece in ("gate", "up") if part == "gate_up" else ("down",):
                if (e, piece, name) not in found:
                    key = f"{self.prefix}layers.{layer}.mlp.experts.{e}.{piece}_proj.{name}"
                    raise CheckpointError("missing tensor", where, key)
                pieces.append(found[(e, piece, name)])
            experts.append(join_pieces(name, pieces))
        return torch.stack(experts)

    def dequantize(self, parts: Parts, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return dequantize_experts(self.method, parts, dtype)
