"""What a compressed-tensors checkpoint (llm-compressor's, `quant_method` "compressed-tensors") declares in
config.json's `quantization_config`, and whether Spillway loads it.

Supported, every config group alike (a mixed-precision checkpoint is refused): `pack-quantized` W4A16 (int4
weights, `group` strategy, group 32, 64 or 128, symmetric or not, no activation quantization),
`nvfp4-pack-quantized` (fp4 weights, `tensor_group` strategy, group 16; activations unquantized or
NVFP4's dynamic-local ones) and `float-quantized` FP8 block (fp8 weights, `block` strategy with a square
block; any dynamic activation scheme, unused by weight-only compute). `quantization_status` must be
"compressed" (or "frozen", as older checkpoints in these formats say). A group's `format` overrides the
global one. The `ignore` list names modules left in the model's dtype ("re:" patterns included).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.model.ct_experts import SCALE_DTYPES, W4A16_GROUPS, CtNvfp4, CtW4A16
from common.model.errors import CheckpointError

CT_METHOD = "compressed-tensors"
PACK, NVFP4, FP8 = "pack-quantized", "nvfp4-pack-quantized", "float-quantized"
CT_SUPPORTED = (
    f"{CT_METHOD} {PACK} W4A16 (int4, group {'/'.join(map(str, W4A16_GROUPS))})",
    f"{CT_METHOD} {NVFP4}",
    f"{CT_METHOD} {FP8} FP8 block",
)
"""What `compressed_tensors_scheme` accepts, as errors list it."""
_PREFIX = "quantization_config."
_DTYPES = {str(d).removeprefix("torch."): d for d in SCALE_DTYPES.values()}


@dataclass(frozen=True)
class CtScheme:
    """A supported compressed-tensors checkpoint's scheme."""

    format: str
    """`PACK` | `NVFP4` | `FP8`."""
    group: int
    """Inputs per scale: the int4 group, 16 for NVFP4, the FP8 block's edge."""
    symmetric: bool = True
    input_scale: bool = False
    """NVFP4 with static activation global scales: each linear stores `input_global_scale`."""
    scale_dtype: torch.dtype = torch.bfloat16
    """W4A16's scale dtype: the model's (config.json's `torch_dtype` or `dtype`)."""

    @property
    def expert_format(self) -> str | None:
        """The expert format whose bits the host store keeps (common/model/ct_experts.py); None for FP8
        block, whose experts load dequantised."""
        if self.format == PACK:
            return CtW4A16(self.group, self.symmetric, self.scale_dtype).name
        return CtNvfp4(self.input_scale).name if self.format == NVFP4 else None


def compressed_tensors_scheme(
    quant: dict[str, Any], config: dict[str, Any], path: Path, supported: tuple[str, ...]
) -> CtScheme:
    """The scheme of `quant` (config.json's quantization_config; `config` the whole file at `path`);
    CheckpointError naming the key of anything unsupported, with the `supported` list."""

    def refuse(what: str, key: str) -> CheckpointError:
        return CheckpointError(f"{what} is not supported (supported: {', '.join(supported)})", path, key)

    status = quant.get("quantization_status", "compressed")
    if status not in ("compressed", "frozen"):  # older checkpoints say "frozen"; `format` is the layout
        raise refuse(f"{CT_METHOD} quantization_status {status!r}", _PREFIX + "quantization_status")
    for key in ("sparsity_config", "transform_config"):
        if quant.get(key):
            raise refuse(f"{CT_METHOD} {key}", _PREFIX + key)
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError("expected an object of quantization groups", path, _PREFIX + "config_groups")
    schemes = {_group(name, body, quant.get("format"), config, path, refuse) for name, body in groups.items()}
    if len(schemes) > 1:
        raise refuse(
            f"{CT_METHOD} with groups of different schemes (mixed precision)", _PREFIX + "config_groups"
        )
    return schemes.pop()


def _group(
    name: str,
    body: Any,
    default_format: Any,
    config: dict[str, Any],
    path: Path,
    refuse: Callable[[str, str], CheckpointError],
) -> CtScheme:
    """One config group's scheme."""
    prefix = f"{_PREFIX}config_groups.{name}."
    if not isinstance(body, dict) or not isinstance(body.get("weights"), dict):
        raise CheckpointError("expected an object with `weights`", path, prefix.removesuffix("."))
    fmt = body.get("format") or default_format
    w, acts = body["weights"], body.get("input_activations")
    fmt_key = prefix + "format" if body.get("format") else _PREFIX + "format"
    if body.get("output_activations"):
        raise refuse(f"{CT_METHOD} output_activations", prefix + "output_activations")
    described = (
        f"{CT_METHOD} {fmt} with weights num_bits={w.get('num_bits')} type={w.get('type')} "
        f"strategy={w.get('strategy')}"
    )
    if fmt == PACK:
        if (w.get("num_bits"), w.get("type"), w.get("strategy")) != (4, "int", "group") or w.get("dynamic"):
            raise refuse(described, prefix + "weights")
        if w.get("group_size") not in W4A16_GROUPS:
            raise refuse(
                f"{CT_METHOD} W4A16 group_size {w.get('group_size')!r}", prefix + "weights.group_size"
            )
        if w.get("actorder") not in (None, "weight", "static"):  # "group" stores a g_idx per input
            raise refuse(f"{CT_METHOD} actorder {w.get('actorder')!r}", prefix + "weights.actorder")
        if acts:
            raise refuse(f"{CT_METHOD} {PACK} with quantized activations", prefix + "input_activations")
        return CtScheme(
            PACK,
            w["group_size"],
            bool(w.get("symmetric", True)),
            False,
            _scale_dtype(w, config, path, prefix),
        )
    if fmt == NVFP4:
        nvfp4 = (w.get("num_bits"), w.get("type"), w.get("group_size"), w.get("symmetric", True)) == (
            4, "float", 16, True,
        )  # fmt: skip
        if not nvfp4 or w.get("strategy") != "tensor_group":
            raise refuse(described, prefix + "weights")
        if acts and (acts.get("num_bits"), acts.get("type"), acts.get("dynamic")) != (4, "float", "local"):
            raise refuse(f"{CT_METHOD} {NVFP4} with those input_activations", prefix + "input_activations")
        return CtScheme(NVFP4, 16, True, bool(acts))
    if fmt == FP8:
        block = w.get("block_structure")
        if (w.get("num_bits"), w.get("type"), w.get("strategy")) != (8, "float", "block"):
            raise refuse(described, prefix + "weights")
        square = isinstance(block, list) and len(block) == 2 and block[0] == block[1]
        if not (square and isinstance(block[0], int) and block[0] > 0):
            raise refuse(f"{CT_METHOD} FP8 block_structure {block!r}", prefix + "weights.block_structure")
        if acts and not acts.get("dynamic"):  # static activation scales: per-tensor input_scale tensors
            raise refuse(f"{CT_METHOD} {FP8} with static input_activations", prefix + "input_activations")
        return CtScheme(FP8, block[0])
    raise refuse(f"{CT_METHOD} format {fmt!r}", fmt_key)


def _scale_dtype(weights: dict[str, Any], config: dict[str, Any], path: Path, prefix: str) -> torch.dtype:
    """The dtype W4A16 scales are stored in: `scale_dtype` if named, else the model's dtype."""
    named = weights.get("scale_dtype")
    name = str(named).removeprefix("torch.") if named else config.get("torch_dtype") or config.get("dtype")
    if name not in _DTYPES:
        key = prefix + "weights.scale_dtype" if named else "dtype" if "dtype" in config else "torch_dtype"
        allowed = ", ".join(_DTYPES)
        raise CheckpointError(f"W4A16 scales in {name!r} are not supported ({allowed})", path, key)
    return _DTYPES[name]
