"""NVFP4 linears outside the routed experts (a dense MLP, a shared expert), dequantised at load: ModelOpt
stores each as `X.weight` (packed e2m1), `X.weight_scale` (e4m3 per 16 inputs), `X.weight_scale_2` (fp32)
and `X.input_scale` (for W4A4 compute; dropped here), and the resident model holds w in its dtype.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import torch

from common.model.checkpoint import TensorSource
from common.model.errors import CheckpointError
from common.model.fp4_blocks import NVFP4_GROUP, dequantize_nvfp4

_SCALES = (".weight_scale", ".weight_scale_2", ".input_scale")


def _read(path: Path, key: str, read) -> torch.Tensor:
    try:
        return read()
    except Exception as exc:
        raise CheckpointError(f"cannot read tensor: {exc}", path, key) from exc


def _dequantized(weight: tuple, scale: tuple, scale_2: tuple) -> torch.Tensor:
    """The linear's w in fp32, each tensor's dtype and shape checked (errors name the offending one)."""
    w, s, s2 = (_read(*entry) for entry in (weight, scale, scale_2))
    out, half = w.shape if w.dim() == 2 else (0, 0)
    for entry, tensor, dtype, shape in (
        (weight, w, torch.uint8, (out, half)),
        (scale, s, torch.float8_e4m3fn, (out, 2 * half // NVFP4_GROUP)),
        (scale_2, s2, torch.float32, ()),
    ):
        if tensor.dtype != dtype:
            raise CheckpointError(f"nvfp4 tensor has dtype {tensor.dtype}, expected {dtype}", *entry[:2])
        if tuple(tensor.shape) != shape and not (shape == () and tuple(tensor.shape) == (1,)):
            raise CheckpointError(
                f"tensor has shape {list(tensor.shape)}, expected {list(shape)}", *entry[:2]
            )
    if w.is_meta:  # (a checkpoint checked from its headers: shapes only)
        return torch.empty((out, 2 * half), dtype=torch.float32, device="meta")
    return dequantize_nvfp4(w, s, s2.reshape(()), torch.float32)


def dequantized_nvfp4_source(source: TensorSource) -> Iterator[tuple]:
    """`source` with each NVFP4 linear as one entry under `X.weight` whose reader returns w in fp32 (its
    scales' keys dropped); a scale without its weight, or a weight_scale without its weight_scale_2, is a
    CheckpointError. Nothing is read here."""
    entries = deque(source)
    by_key = {key: entry for entry in entries for key in (entry[1],)}
    scaled: dict[str, tuple] = {}
    dropped: set[str] = set()
    for path, key, _ in entries:
        if not key.endswith(_SCALES):
            continue
        module = next(key.removesuffix(s) for s in _SCALES if key.endswith(s))
        if f"{module}.weight" not in by_key:
            raise CheckpointError(f"nvfp4 scale without its weight {module}.weight", path, key)
        dropped.add(key)
        if key.endswith(".weight_scale"):
            if f"{module}.weight_scale_2" not in by_key:
                raise CheckpointError("missing tensor", path, f"{module}.weight_scale_2")
            scaled[f"{module}.weight"] = (by_key[key], by_key[f"{module}.weight_scale_2"])
    while entries:
        path, key, _ = entry = entries.popleft()
        if key in scaled:
            yield path, key, functools.partial(_dequantized, entry, *scaled.pop(key))
        elif key not in dropped:
            yield entry
