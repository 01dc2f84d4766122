"""Runtime artifacts: a checkpoint converted once into resident weights plus a packed expert file.

`convert` writes DST with the source's config and tokenizer files, every tensor that is not a routed expert
(in safetensors shards, keys unchanged; quantized linears dequantised), and `experts.bin`: the host expert
store's exact bytes in the chosen format (one of FORMATS or PUBLISHED_FORMATS), described by
`experts.json`. Loading an artifact maps `experts.bin` in place (and registers it on a CUDA machine)
instead of re-quantising anything.

DST must not exist yet (or be empty): the artifact is written beside it and renamed into place when whole,
so a conversion that fails (a tensor of the wrong shape, a format the sizes cannot take) leaves nothing
behind, and one never overwrites a checkpoint. Tensors are checked as the loader checks them, naming the
source's file and key.
"""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.config import is_artifact as is_artifact  # re-exported: callers take it from here
from common.experts.formats import get_format
from common.experts.store import HostExpertStore
from common.model.errors import CheckpointError
from common.model.hf_config import load_architecture, read_json
from common.model.loader import (
    ARTIFACT_META,
    INDEX_FILE,
    check_shape,
    check_weight,
    expert_shape,
    meta_model,
    model_source,
    safetensors_source,
)
from common.model.published_experts import PublishedExperts
from common.model.registry import ExpertKey
from common.progress import progress

META_FILE, EXPERTS_FILE = ARTIFACT_META, "experts.bin"
_SHARD_BYTES = 2 * 10**9
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.bfloat16,
        torch.float16,
        torch.float32,
        torch.float8_e4m3fn,
        torch.uint8,
        torch.int8,
        torch.int32,
    )
}


def convert(src: str | Path, dst: str | Path, fmt_name: str, log: Callable[[str], None] = print) -> dict:
    """Convert checkpoint `src` into an artifact at `dst` with experts in `fmt_name` (FORMATS or
    PUBLISHED_FORMATS); return its metadata, with the relative error the packing added to the gate_up and
    down weights (against the source's experts, dequantised where published quantized: re-packing a
    published format into itself copies its bits and adds none)."""
    src, dst = Path(src), Path(dst)
    arch, cfg = load_architecture(src)
    fmt = get_format(fmt_name)
    components = fmt.components(cfg.hidden_size, cfg.moe_intermediate_size)  # a format the sizes cannot take
    _check_destination(src, dst)
    work = dst.with_name(f".{dst.name}.converting")
    shutil.rmtree(work, ignore_errors=True)  # a conversion that was killed
    work.mkdir(parents=True)
    try:
        meta = _convert_into(arch, cfg, fmt, components, src, work, log)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    if dst.exists():
        dst.rmdir()  # empty (checked)
    work.rename(dst)
    return meta


def _check_destination(src: Path, dst: Path) -> None:
    if dst.resolve() == src.resolve():
        raise ValueError(f"convert: the destination {dst} is the source checkpoint")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(
            f"convert: {dst} exists and is not empty (an artifact is written as a new directory)"
        )


def _convert_into(arch, cfg, fmt, components: dict, src: Path, dst: Path, log: Callable[[str], None]) -> dict:
    for f in src.iterdir():  # config, generation config, tokenizer, chat template
        if f.is_file() and f.suffix in (".json", ".jinja", ".txt", ".model") and f.name != INDEX_FILE:
            shutil.copy(f, dst / f.name)
    experts: dict[int, dict] = defaultdict(dict)
    source, published = model_source(src, arch, cfg, safetensors_source(src))
    resident_keys = _write_resident(arch, cfg, source, dst, experts)
    layers = sorted(cfg.moe_layers)
    store = HostExpertStore(
        len(layers),
        cfg.num_experts,
        components,
        map_for_gpu=False,
        backing=dst / EXPERTS_FILE,
        writable_file=True,
    )
    err = {"gate_up": [0.0, 0.0], "down": [0.0, 0.0]}
    by_layer = published.layers(src) if published is not None else {}
    for i, layer in enumerate(progress(layers, f"packing {fmt.name} experts", unit="layer")):
        if published is not None:
            packed = _repack_published(fmt, published, by_layer.pop(layer), err)
        else:
            packed = [
                _pack_expert(fmt, cfg, experts[layer], layer, e, err, src) for e in range(cfg.num_experts)
            ]
        store.fill(i, packed)
        experts.pop(layer, None)
        log(f"layer {layer}: {cfg.num_experts} experts packed as {fmt.name}")
    assert store._mmap is not None  # a store with a backing file maps it
    store._mmap.flush()
    errors = {k: (s / n) ** 0.5 if n else 0.0 for k, (s, n) in err.items()}
    meta = {
        "format": fmt.name,
        "moe_layers": layers,
        "num_experts": cfg.num_experts,
        "components": {n: [list(s), str(d).removeprefix("torch.")] for n, (s, d) in components.items()},
        "nbytes": store.nbytes,
        "quantization_error": errors,
        "resident_tensors": resident_keys,
    }
    (dst / META_FILE).write_text(json.dumps(meta, indent=1))
    log(
        f"quantization error ({fmt.name}): gate_up {errors['gate_up']:.3%}, down {errors['down']:.3%} "
        "(relative Frobenius)"
    )
    return meta


def _write_resident(arch, cfg, source, dst: Path, experts: dict) -> int:
    """Stream every non-expert tensor of `source` (`model_source`'s: quantized linears dequantised) into
    shards; keep readers for the experts, by layer."""
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    names: list[str] = []

    def flush() -> None:
        if shard:
            name = f"model-resident-{len(names) + 1:05d}.safetensors"
            save_file(shard, dst / name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            names.append(name)
            shard.clear()

    size = total = 0
    shapes = {name: p.shape for name, p in meta_model(arch, cfg, torch.float32).named_parameters()}
    for path, key, read in source:
        target = arch.map_key(key, cfg)
        if isinstance(target, ExpertKey):  # read later, a layer at a time
            experts[target.layer][(target.expert, target.part)] = (path, key, target, read)
            continue
        tensor = read()
        if isinstance(target, str) and target in shapes:  # as the loader will check it, naming the source
            check_weight(tensor, path, key)
            check_shape(tensor, tuple(shapes[target]), path, key)
        shard[key] = tensor.contiguous()  # a dequantised linear may be a transposed view
        size += tensor.numel() * tensor.element_size()
        total += tensor.numel() * tensor.element_size()
        if size >= _SHARD_BYTES:
            flush()
            size = 0
    flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dst / INDEX_FILE).write_text(json.dumps(index))
    return len(weight_map)


def _pack_expert(fmt, cfg, parts: dict, layer: int, e: int, err: dict, src: Path) -> dict:
    """Read one expert (per-expert or fused keys), check it, pack it, and add its round-trip error to `err`.
    `parts[(expert, part)]` is (file, key, ExpertKey, read) as `_write_resident` found it."""
    if (None, "gate_up") in parts:
        gate_up, down = (_read_expert(cfg, *parts[(None, p)])[e] for p in ("gate_up", "down"))
    else:
        for part in ("gate", "up", "down"):
            if (e, part) not in parts:  # named as the loader names a missing expert tensor
                raise CheckpointError(
                    "missing tensor", src, f"model.layers.{layer}.mlp.experts.{e}.{part}_proj.weight"
                )
        gate_up = torch.cat([_read_expert(cfg, *parts[(e, "gate")]), _read_expert(cfg, *parts[(e, "up")])])
        down = _read_expert(cfg, *parts[(e, "down")])
    return _pack_measured(fmt, gate_up, down, err)


def _pack_measured(fmt, gate_up: torch.Tensor, down: torch.Tensor, err: dict) -> dict:
    """`fmt.pack` of one expert, its round trip's squared error and squared norm added to `err`."""
    packed = fmt.pack(gate_up, down)
    got_gu, got_d = fmt.unpack(packed, torch.float32)
    for name, ref, got in (("gate_up", gate_up.float(), got_gu), ("down", down.float(), got_d)):
        err[name][0] += float((got - ref).pow(2).sum())
        err[name][1] += float(ref.pow(2).sum())
    return packed


def _repack_published(fmt, published: PublishedExperts, parts: dict, err: dict) -> list[dict]:
    """One layer's published components [E, ...] as `fmt`'s per-expert parts: the same bits where `fmt` is
    the published format, else dequantised (fp32) and packed, the error added to `err`."""
    experts = range(published.cfg.num_experts)
    if fmt.name == published.fmt:
        return [{name: t[e] for name, t in parts.items()} for e in experts]
    gate_up, down = published.dequantize(parts, torch.float32)  # [E, 2I, H], [E, H, I]
    return [_pack_measured(fmt, gate_up[e], down[e], err) for e in experts]


def _read_expert(cfg, path: Path, key: str, ek: ExpertKey, read: Callable[[], torch.Tensor]) -> torch.Tensor:
    tensor = read()
    check_weight(tensor, path, key)
    check_shape(tensor, expert_shape(cfg, ek), path, key)
    return tensor


def open_store(model_dir: str | Path) -> tuple[HostExpertStore, dict]:
    """Map an artifact's experts.bin (registered for the GPU where there is one) and return its metadata."""
    model_dir = Path(model_dir)
    path = model_dir / META_FILE
    meta = read_json(path)
    for key in ("components", "moe_layers", "num_experts", "nbytes"):
        if key not in meta:
            raise CheckpointError("required field missing", path, key)
    try:
        components = {n: (tuple(s), _DTYPES[d]) for n, (s, d) in meta["components"].items()}
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"components must map names to [shape, dtype] ({exc})", path, "components"
        ) from None
    if not (model_dir / EXPERTS_FILE).is_file():
        raise CheckpointError("file not found", model_dir / EXPERTS_FILE)
    store = HostExpertStore(
        len(meta["moe_layers"]), meta["num_experts"], components, backing=model_dir / EXPERTS_FILE
    )
    if store.nbytes != meta["nbytes"]:
        raise CheckpointError(
            f"layout of {store.nbytes} bytes, metadata says {meta['nbytes']}", model_dir / META_FILE
        )
    return store, meta
