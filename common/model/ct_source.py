"""A compressed-tensors checkpoint's tensors as the loader takes them (ct_blocks.py has the layouts).

- `CtPublishedExperts`: the routed experts of a pack-quantized or nvfp4-pack-quantized checkpoint, per
  expert linear (`<expert>.<gate|up|down>_proj.<tensor>`, as llm-compressor saves a MoE), taken out of the
  stream in their stored bits (but the unpacked zero points of compressed-tensors before 0.10, packed as
  it packs them now); each tensor's dtype and shape checked, and `weight_shape` against the linear's dims.
- `dequantized_ct_source`: every other quantized linear (attention, a dense MLP, a shared expert; FP8
  block's experts too) as one entry under `X.weight` whose reader returns w in fp32.

Errors name the file and key of the offending tensor.
"""

from __future__ import annotations

import functools
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from common.config import ModelConfig
from common.model.checkpoint import TensorSource
from common.model.ct_blocks import dequantize_ct_nvfp4, dequantize_w4a16, pack_int32_rows
from common.model.ct_experts import CT_EXPERT_FORMATS, CtExpertFormat, CtNvfp4, CtW4A16
from common.model.ct_scheme import FP8, NVFP4, PACK, CtScheme
from common.model.errors import CheckpointError
from common.model.fp8_blocks import dequantize_fp8_block
from common.model.layers import activation
from common.model.published_experts import Parts, PublishedExperts
from common.model.registry import Architecture, ExpertKey
from common.model.resident import ResidentExperts

_SHAPE = "weight_shape"  # pack-quantized's record of [out, in]: checked, not kept
_Entry = tuple[Path, str, Callable[[], torch.Tensor]]
Dims = Callable[[str], tuple[int, int] | None]
"""A linear's module name -> its (out, in) in the model, None where the model has no such linear."""


def _read(entry: _Entry) -> torch.Tensor:
    path, key, read = entry
    try:
        return read()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"cannot read tensor: {exc}", path, key) from exc


def _check(tensor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], path: Path, key: str) -> None:
    if tensor.dtype != dtype:
        raise CheckpointError(f"tensor has dtype {tensor.dtype}, expected {dtype}", path, key)
    if tuple(tensor.shape) != shape:
        raise CheckpointError(f"tensor has shape {list(tensor.shape)}, expected {list(shape)}", path, key)


def _check_dims(record: torch.Tensor, out: int, inp: int, path: Path, key: str) -> None:
    """`weight_shape` (int64 [2]) says [out, in]."""
    _check(record, torch.int64, (2,), path, key)
    if not record.is_meta and record.tolist() != [out, inp]:
        raise CheckpointError(f"weight_shape {record.tolist()} is not [{out}, {inp}]", path, key)


def _zero_point(tensor: torch.Tensor, name: str, spec: CtExpertFormat, out: int, inp: int) -> torch.Tensor:
    """A W4A16 tensor as the format keeps it: zero points that compressed-tensors before 0.10 wrote
    unpacked (int8 [out, in/group]) packed as it packs them now (lossless); anything else as it is."""
    if name != "weight_zero_point" or not isinstance(spec, CtW4A16) or tensor.dtype != torch.int8:
        return tensor
    if tuple(tensor.shape) != (out, inp // spec.group):
        return tensor
    if tensor.is_meta:
        return torch.empty(spec.tensor_shape(name, out, inp), dtype=torch.int32, device="meta")
    return pack_int32_rows(tensor)


class CtPublishedExperts(PublishedExperts):
    """Takes a compressed-tensors expert format's tensors (ct_experts.py) out of a checkpoint's stream and
    assembles, per MoE layer, the format's components [E, ...] in their stored bits."""

    def __init__(self, fmt: str, arch: Architecture, cfg: ModelConfig, config_path: Path) -> None:
        self.fmt, self.arch, self.cfg = fmt, arch, cfg
        self.spec: CtExpertFormat = CT_EXPERT_FORMATS[fmt]
        try:
            self.spec.components(cfg.hidden_size, cfg.moe_intermediate_size)
        except ValueError as exc:
            raise CheckpointError(str(exc), config_path, "moe_intermediate_size") from exc
        self.found: dict[int, dict[tuple[int | None, str, str], torch.Tensor]] = defaultdict(dict)

    def match(self, key: str) -> tuple[ExpertKey, str, torch.dtype] | None:
        module, _, name = key.rpartition(".")
        if name not in self.spec.tensors and name != _SHAPE:
            return None
        target = self.arch.map_key(module + ".weight", self.cfg)
        if not isinstance(target, ExpertKey):
            return None
        return target, name, self.spec.tensors.get(name, torch.int64)

    def _add(self, ek: ExpertKey, name: str, dtype: torch.dtype, tensor: torch.Tensor, path: Path, key: str):
        cfg = self.cfg
        if ek.layer not in cfg.moe_layers or ek.expert is None or ek.expert >= cfg.num_experts:
            raise CheckpointError("expert weight for a layer or expert the config does not have", path, key)
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        out, inp = (h, i) if ek.part == "down" else (i, h)
        if name == _SHAPE:
            _check_dims(tensor, out, inp, path, key)
            return
        tensor = _zero_point(tensor, name, self.spec, out, inp)
        _check(tensor, dtype, self.spec.tensor_shape(name, out, inp), path, key)
        if (ek.expert, ek.part, name) in self.found[ek.layer]:
            raise CheckpointError("tensor appears twice in the checkpoint", path, key)
        self.found[ek.layer][(ek.expert, ek.part, name)] = tensor

    def layers(self, where: Path) -> dict[int, Parts]:
        comps = list(self.spec.components(self.cfg.hidden_size, self.cfg.moe_intermediate_size))
        out: dict[int, Parts] = {}
        for layer in self.cfg.moe_layers:
            found = self.found.pop(layer, {})
            out[layer] = {c: self._component(found, layer, c, where) for c in comps}
        return out

    def dequantize(self, parts: Parts, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.spec.unpack_many(parts, dtype)

    def _missing_key(self, layer: int, expert: int, piece: str, name: str) -> str:
        return f"{self.prefix}layers.{layer}.mlp.experts.{expert}.{piece}_proj.{name}"


# --- the other linears, dequantised -----------------------------------------------------------------------


def _dims(entries: dict[str, _Entry], known: tuple[int, int] | None, per_byte: int) -> tuple[int, int]:
    """The linear's (out, in): the model's, else its packed weight's (`per_byte` inputs a byte)."""
    if known is not None:
        return known
    packed = _read(entries["weight_packed"])
    rows, cols = packed.shape if packed.dim() == 2 else (0, 0)
    return rows, cols * packed.dtype.itemsize * per_byte


def _pack_quantized(entries: dict[str, _Entry], ct: CtScheme, known: tuple[int, int] | None) -> torch.Tensor:
    out, inp = _dims(entries, known, 2)
    spec = CtW4A16(ct.group, ct.symmetric, ct.scale_dtype)
    read = {}
    for name, dtype in spec.tensors.items():
        read[name] = _zero_point(_read(entries[name]), name, spec, out, inp)
        _check(read[name], dtype, spec.tensor_shape(name, out, inp), *entries[name][:2])
    _check_dims(_read(entries[_SHAPE]), out, inp, *entries[_SHAPE][:2])
    packed = read["weight_packed"]
    if packed.is_meta:  # (a checkpoint checked from its headers: shapes only)
        return torch.empty((out, inp), dtype=torch.float32, device="meta")
    return dequantize_w4a16(packed, read["weight_scale"], read.get("weight_zero_point"), torch.float32)


def _nvfp4(entries: dict[str, _Entry], ct: CtScheme, known: tuple[int, int] | None) -> torch.Tensor:
    spec = CtNvfp4(ct.input_scale)
    out, inp = _dims(entries, known, 2)
    read = {}
    for name, dtype in spec.tensors.items():
        read[name] = _read(entries[name])
        _check(read[name], dtype, spec.tensor_shape(name, out, inp), *entries[name][:2])
    packed = read["weight_packed"]
    if packed.is_meta:
        return torch.empty((out, inp), dtype=torch.float32, device="meta")
    return dequantize_ct_nvfp4(packed, read["weight_scale"], read["weight_global_scale"], torch.float32)


def _fp8_block(entries: dict[str, _Entry], ct: CtScheme, known: tuple[int, int] | None) -> torch.Tensor:
    weight_e, scale_e = entries["weight"], entries["weight_scale"]
    weight, scale = _read(weight_e), _read(scale_e)
    out, inp = known or (weight.shape if weight.dim() == 2 else (0, 0))
    _check(weight, torch.float8_e4m3fn, (out, inp), *weight_e[:2])
    if not scale.dtype.is_floating_point or scale.dtype.itemsize < 2:
        raise CheckpointError(f"tensor has dtype {scale.dtype}, expected a 16- or 32-bit float", *scale_e[:2])
    _check(scale, scale.dtype, (-(-out // ct.group), -(-inp // ct.group)), *scale_e[:2])
    if weight.is_meta:
        return torch.empty((out, inp), dtype=torch.float32, device="meta")
    return dequantize_fp8_block(weight, scale, ct.group, torch.float32)


_Dequantize = Callable[[dict[str, _Entry], CtScheme, tuple[int, int] | None], torch.Tensor]
_LINEAR: dict[str, tuple[tuple[str, ...], _Dequantize]] = {
    PACK: (("weight_packed", "weight_scale", _SHAPE, "weight_zero_point"), _pack_quantized),
    NVFP4: (("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"), _nvfp4),
    FP8: (("weight", "weight_scale"), _fp8_block),
}
"""Per format: a quantized linear's tensor names (the first marks one) and its dequantiser."""


def _required(ct: CtScheme) -> tuple[str, ...]:
    names, _ = _LINEAR[ct.format]
    if ct.format == PACK:
        return names if not ct.symmetric else names[:3]
    if ct.format == NVFP4:
        return names if ct.input_scale else names[:3]
    return names


def linear_dims(arch: Architecture, cfg: ModelConfig) -> Dims:
    """The (out, in) of each linear of `arch` for `cfg` (from the model built on the meta device), by the
    module name a checkpoint gives it."""
    with torch.device("meta"):
        model = arch.build(cfg, ResidentExperts({}, activation(cfg.hidden_act)))
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters() if p.dim() == 2}

    def dims(module: str) -> tuple[int, int] | None:
        target = arch.map_key(f"{module}.weight", cfg)
        if isinstance(target, ExpertKey):
            h, i = cfg.hidden_size, cfg.moe_intermediate_size
            return (h, i) if target.part == "down" else (i, h) if target.expert is not None else None
        shape = shapes.get(target) if isinstance(target, str) else None
        return (shape[0], shape[1]) if shape is not None else None

    return dims


def dequantized_ct_source(
    source: TensorSource, ct: CtScheme, dims: Dims = lambda module: None
) -> Iterator[_Entry]:
    """`source` with each quantized linear of `ct`'s format as one entry under `X.weight` whose reader
    returns w in fp32 (its other tensors' keys dropped); each tensor checked against the linear's `dims`
    (else against its packed weight's). A linear missing one of its tensors is a CheckpointError naming the
    missing key; nothing is read here."""
    names, dequantize = _LINEAR[ct.format]
    required = _required(ct)
    entries = deque(source)
    modules: dict[str, dict[str, _Entry]] = defaultdict(dict)
    for entry in entries:
        module, _, name = entry[1].rpartition(".")
        if name in names:
            modules[module][name] = entry
    linears: dict[str, dict[str, _Entry]] = {}
    for module, parts in modules.items():
        if names[0] not in parts:
            if ct.format == FP8:  # a `weight_scale` alone is left to the loader (not an FP8 linear's)
                continue
            path, key, _ = next(iter(parts.values()))
            raise CheckpointError(f"{ct.format} tensor without its {module}.{names[0]}", path, key)
        if ct.format == FP8 and "weight_scale" not in parts:
            continue  # an unquantized linear (ignored by the recipe): its weight loads as it is
        for name in required:
            if name not in parts:
                raise CheckpointError("missing tensor", parts[names[0]][0], f"{module}.{name}")
        linears[module] = parts
    dropped = {entry[1] for parts in linears.values() for entry in parts.values()}
    while entries:
        path, key, read = entries.popleft()
        module, _, name = key.rpartition(".")
        if module in linears and name == names[0]:
            yield (
                path,
                f"{module}.weight",
                functools.partial(dequantize, linears.pop(module), ct, dims(module)),
            )
        elif key not in dropped:
            yield path, key, read
