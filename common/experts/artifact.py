"""Runtime artifacts: a checkpoint converted once into resident weights plus a packed expert file.

`convert` writes DST with the source's config and tokenizer files, every tensor that is not a routed expert
(in safetensors shards, keys unchanged), and `experts.bin`: the host expert store's exact bytes in the chosen
format, described by `experts.json`. Loading an artifact maps `experts.bin` in place (and registers it on a
CUDA machine) instead of re-quantising anything.
"""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.experts.formats import get_format
from common.experts.store import HostExpertStore
from common.model.errors import CheckpointError
from common.model.hf_config import load_architecture, read_json
from common.model.loader import (
    ARTIFACT_META,
    INDEX_FILE,
    dequantized_fp8_source,
    fp8_block_size,
    safetensors_source,
)
from common.model.registry import ExpertKey, HostTableKey

META_FILE, EXPERTS_FILE = ARTIFACT_META, "experts.bin"
_SHARD_BYTES = 2 * 10**9
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8, torch.int8)
}


def is_artifact(model_dir: str | Path) -> bool:
    return (Path(model_dir) / META_FILE).is_file()


def convert(src: str | Path, dst: str | Path, fmt_name: str, log: Callable[[str], None] = print) -> dict:
    """Convert checkpoint `src` into an artifact at `dst` with experts in `fmt_name`; return its metadata
    (including the relative quantisation error of the gate_up and down weights)."""
    src, dst = Path(src), Path(dst)
    arch, cfg = load_architecture(src)
    fmt = get_format(fmt_name)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():  # config, generation config, tokenizer, chat template
        if f.is_file() and f.suffix in (".json", ".jinja", ".txt", ".model") and f.name != INDEX_FILE:
            shutil.copy(f, dst / f.name)
    experts: dict[int, dict] = defaultdict(dict)
    resident_keys = _write_resident(arch, cfg, src, dst, experts)
    layers = sorted(cfg.moe_layers)
    components = fmt.components(cfg.hidden_size, cfg.moe_intermediate_size)
    store = HostExpertStore(
        len(layers),
        cfg.num_experts,
        components,
        map_for_gpu=False,
        backing=dst / EXPERTS_FILE,
        writable_file=True,
    )
    err = {"gate_up": [0.0, 0.0], "down": [0.0, 0.0]}
    for i, layer in enumerate(layers):
        packed = [_pack_expert(fmt, experts[layer], layer, e, err, src) for e in range(cfg.num_experts)]
        store.fill(i, packed)
        experts.pop(layer)
        log(f"layer {layer}: {cfg.num_experts} experts packed as {fmt.name}")
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


def _write_resident(arch, cfg, src: Path, dst: Path, experts: dict) -> int:
    """Stream every non-expert tensor into shards; keep readers for the experts, by layer."""
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
    # FP8 checkpoints: block-scaled weights arrive dequantized (float32), their scales dropped
    keep = lambda key: isinstance(arch.map_key(key, cfg), HostTableKey)  # the n-gram table stays fp8
    for _path, key, read in dequantized_fp8_source(safetensors_source(src), fp8_block_size(src), keep):
        target = arch.map_key(key, cfg)
        if isinstance(target, ExpertKey):  # read later, a layer at a time
            experts[target.layer][(target.expert, target.part)] = read
            continue
        tensor = read()
        shard[key] = tensor
        size += tensor.numel() * tensor.element_size()
        total += tensor.numel() * tensor.element_size()
        if size >= _SHARD_BYTES:
            flush()
            size = 0
    flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dst / INDEX_FILE).write_text(json.dumps(index))
    return len(weight_map)


def _pack_expert(fmt, parts: dict, layer: int, e: int, err: dict, src: Path) -> dict:
    """Read one expert (per-expert or fused keys), pack it, and add its round-trip error to `err`."""
    if (None, "gate_up") in parts:
        gate_up, down = (parts[(None, p)]()[e] for p in ("gate_up", "down"))
    else:
        try:
            gate_up = torch.cat([parts[(e, "gate")](), parts[(e, "up")]()])
            down = parts[(e, "down")]()
        except KeyError as exc:
            raise CheckpointError(
                "missing tensor", src, f"layer {layer} expert {e} {exc.args[0][1]}"
            ) from exc
    packed = fmt.pack(gate_up, down)
    got_gu, got_d = fmt.unpack(packed, torch.float32)
    for name, ref, got in (("gate_up", gate_up.float(), got_gu), ("down", down.float(), got_d)):
        err[name][0] += float((got - ref).pow(2).sum())
        err[name][1] += float(ref.pow(2).sum())
    return packed


def open_store(model_dir: str | Path) -> tuple[HostExpertStore, dict]:
    """Map an artifact's experts.bin (registered for the GPU where there is one) and return its metadata."""
    model_dir = Path(model_dir)
    meta = read_json(model_dir / META_FILE)
    components = {n: (tuple(s), _DTYPES[d]) for n, (s, d) in meta["components"].items()}
    store = HostExpertStore(
        len(meta["moe_layers"]), meta["num_experts"], components, backing=model_dir / EXPERTS_FILE
    )
    if store.nbytes != meta["nbytes"]:
        raise CheckpointError(
            f"layout of {store.nbytes} bytes, metadata says {meta['nbytes']}", model_dir / META_FILE
        )
    return store, meta
