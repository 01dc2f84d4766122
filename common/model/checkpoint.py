"""A checkpoint directory's files: its JSON, its safetensors shards read lazily (or as their headers
describe them), the checks of a tensor."""

from __future__ import annotations

import functools
import json
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from common.model.errors import CheckpointError
from common.progress import progress


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, or a CheckpointError naming the file."""
    if not path.is_file():
        raise CheckpointError("file not found", path)
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"not valid JSON: {exc}", path) from exc
    if not isinstance(data, dict):
        raise CheckpointError("expected a JSON object", path)
    return data


INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(model_dir: str | Path) -> dict[Path, list[str] | None]:
    """Each safetensors file of the checkpoint, with the keys the index assigns to it (None: no index)."""
    root = Path(model_dir)
    index_path = root / INDEX_FILE
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError("index has no weight_map", index_path, "weight_map")
        files: dict[Path, list[str]] = defaultdict(list)
        for key, name in weight_map.items():
            if not isinstance(name, str):
                raise CheckpointError(f"weight_map names a file {name!r}, not a file name", index_path, key)
            files[root / name].append(key)
        for path, keys in files.items():
            if not path.is_file():
                raise CheckpointError(f"missing shard {path.name} listed in {INDEX_FILE}", path, keys[0])
        return dict(files)
    single = sorted(root.glob("*.safetensors"))
    if not single:
        raise CheckpointError("no safetensors weights found", root)
    return dict.fromkeys(single)


def check_weight(tensor: torch.Tensor, path: Path, key: str) -> None:
    """A weight is a floating-point tensor: integers or booleans cast into the model's dtype would load
    without a word and compute garbage."""
    if not tensor.is_floating_point():
        dtype = str(tensor.dtype).removeprefix("torch.")
        raise CheckpointError(f"tensor has dtype {dtype}, expected a floating-point weight", path, key)


def check_shape(tensor: torch.Tensor, shape: tuple[int, ...], path: Path, key: str) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise CheckpointError(f"tensor has shape {list(tensor.shape)}, expected {list(shape)}", path, key)


TensorSource = Iterable[tuple[Path, str, Callable[[], torch.Tensor]]]
"""(file, key, read) triples: where a tensor comes from, its checkpoint key, and how to read it."""


def safetensors_source(model_dir: str | Path) -> Iterator[tuple[Path, str, Callable[[], torch.Tensor]]]:
    """Every tensor of a safetensors checkpoint, read lazily, file by file.

    A reader stays valid after the source has moved on to the next file (a file stays mapped while any of
    its readers lives), so a consumer may gather readers first, as `dequantized_fp8_source` does.
    """
    files = checkpoint_files(model_dir)
    for path in progress(files, f"reading {Path(model_dir).name}", total=len(files), unit="file"):
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error types for truncated/corrupt headers
            raise CheckpointError(f"cannot read safetensors file: {exc}", path) from exc
        for key in handle.keys():  # noqa: SIM118  (safe_open is not a mapping)
            yield path, key, functools.partial(handle.get_tensor, key)


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
"""safetensors' dtype names (a header's) as torch dtypes."""


def header_source(model_dir: str | Path) -> Iterator[tuple[Path, str, Callable[[], torch.Tensor]]]:
    """Every tensor of a safetensors checkpoint as its header describes it: a reader of a tensor of its
    shape and dtype on the meta device (no data read). Opening a file checks its header and that every
    tensor's bytes lie within it (safetensors does, as it opens one); a key the index assigns to a file
    must be in it. CheckpointError naming the file (and key) where not."""
    for path, listed in checkpoint_files(model_dir).items():
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error types for truncated/corrupt headers
            raise CheckpointError(f"cannot read safetensors file: {exc}", path) from exc
        keys = list(handle.keys())
        absent = sorted(set(listed or ()) - set(keys))
        if absent:
            raise CheckpointError(f"tensor missing from the shard {INDEX_FILE} names", path, absent[0])
        for key in keys:
            part = handle.get_slice(key)
            dtype, shape = _DTYPES.get(part.get_dtype()), tuple(part.get_shape())
            if dtype is None:
                raise CheckpointError(f"tensor has dtype {part.get_dtype()}, not one supported", path, key)
            yield path, key, functools.partial(torch.empty, shape, dtype=dtype, device="meta")
