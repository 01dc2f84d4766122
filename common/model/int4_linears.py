"""GPTQ / AWQ linears outside the routed experts (attention, a dense MLP, a shared expert, a quantized
lm_head), dequantised at load: `X.qweight`, `X.qzeros`, `X.scales` (and GPTQ's `X.g_idx`) become one
`X.weight` in fp32, which the loader casts to the model dtype as any tensor. `X.bias` passes as it is.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from common.model.checkpoint import TensorSource
from common.model.errors import CheckpointError
from common.model.int4_blocks import (
    dequantize_linear,
    linear_names,
    linear_shapes,
    num_groups,
    parse_int4_format_name,
)


def _read(path: Path, key: str, read) -> torch.Tensor:
    try:
        return read()
    except Exception as exc:
        raise CheckpointError(f"cannot read tensor: {exc}", path, key) from exc


def _dequantized(
    method: str, group: int, entries: dict[str, tuple], dims: tuple[int, ...] | None
) -> torch.Tensor:
    """The linear's w [out, in] in fp32, each tensor's dtype and shape checked against the weight's `dims`
    (the model's; else as its qweight implies them), errors naming the offending tensor."""
    t = {name: _read(*entry) for name, entry in entries.items()}
    qweight = t["qweight"]
    if dims is None or len(dims) != 2:
        if qweight.dim() != 2:
            got = list(qweight.shape)
            raise CheckpointError(f"qweight has shape {got}, want 2-D", *entries["qweight"][:2])
        rows, cols = qweight.shape
        dims = (cols * 8, rows) if method == "awq" else (cols, rows * 8)
    out, inp = dims
    try:
        shapes = linear_shapes(method, group, out, inp)
    except ValueError as exc:
        raise CheckpointError(f"{method} linear: {exc}", *entries["qweight"][:2]) from None
    for name, (shape, dtype) in shapes.items():
        tensor, (path, key, _) = t[name], entries[name]
        if tensor.dtype != dtype:
            raise CheckpointError(f"{method} {name} has dtype {tensor.dtype}, expected {dtype}", path, key)
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"tensor has shape {list(tensor.shape)}, expected {list(shape)}", path, key)
    if qweight.is_meta:  # (a checkpoint checked from its headers: shapes only)
        return torch.empty((out, inp), dtype=torch.float32, device="meta")
    if "g_idx" in t and t["g_idx"].numel():
        groups, g_idx = num_groups(inp, group), t["g_idx"]
        if not (int(g_idx.min()) >= 0 and int(g_idx.max()) < groups):
            raise CheckpointError(f"g_idx names a group outside 0..{groups - 1}", *entries["g_idx"][:2])
    return dequantize_linear(method, t, torch.float32)


def dequantized_int4_source(
    source: TensorSource, fmt: str, weight_shape: Callable[[str], tuple[int, ...] | None]
) -> Iterator[tuple]:
    """`source` with each linear of the GPTQ / AWQ format `fmt` (int4_blocks' name) as one entry under
    `X.weight` whose reader returns w in fp32 (its other keys dropped); `weight_shape(key)` is the model's
    [out, in] for such a key (None: unknown). A companion tensor without its qweight, or a qweight without a
    companion, is a CheckpointError. Nothing is read here."""
    parsed = parse_int4_format_name(fmt)
    if parsed is None:
        raise ValueError(f"{fmt!r} is not a GPTQ or AWQ format")
    method, group = parsed
    names = linear_names(method)
    entries = deque(source)
    by_key = {entry[1]: entry for entry in entries}
    linears: dict[str, dict[str, tuple]] = {}
    dropped: set[str] = set()
    for path, key, _ in entries:
        module, _, name = key.rpartition(".")
        if name not in names:
            continue
        if f"{module}.qweight" not in by_key:
            raise CheckpointError(f"{method} {name} without its qweight {module}.qweight", path, key)
        dropped.add(key)
        if name == "qweight":
            for other in names:
                if f"{module}.{other}" not in by_key:
                    raise CheckpointError("missing tensor", path, f"{module}.{other}")
            linears[key] = {other: by_key[f"{module}.{other}"] for other in names}
    while entries:
        path, key, _ = entry = entries.popleft()
        if key in linears:
            weight = key.removesuffix(".qweight") + ".weight"
            read = functools.partial(_dequantized, method, group, linears.pop(key), weight_shape(weight))
            yield path, weight, read
        elif key not in dropped:
            yield entry
