"""Load a local HF checkpoint directory (safetensors, sharded or not) into the runtime.

Every failure a user can cause — unknown model_type, missing shard, missing, misshapen or unreadable tensor —
is a CheckpointError that names the file and the key.

Hugging Face FP8 checkpoints (Qwen3-FP8, DeepSeek-V3: a linear's `X.weight` in float8_e4m3fn with a sibling
`X.weight_scale_inv` per 128×128 block) load dequantized: `dequantized_fp8_source` pairs each weight with its
scale and hands the loader w = fp8 · scale_inv in float32, which it casts to the model dtype as any tensor.
NVFP4 (ModelOpt) and MXFP4 (gpt-oss) checkpoints keep their routed experts in their published bits
(published_experts.py); their other NVFP4 linears load dequantised (nvfp4_linears.py). GPTQ and AWQ
checkpoints likewise (int4_experts.py, int4_linears.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import re
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Protocol, cast

import torch
from torch import nn

from common.config import ARTIFACT_META, ModelConfig
from common.model.checkpoint import (
    INDEX_FILE,
    TensorSource,
    check_shape,
    check_weight,
    header_source,
    read_json,
    safetensors_source,
)
from common.model.ct_source import CtPublishedExperts, dequantized_ct_source, linear_dims
from common.model.errors import CheckpointError
from common.model.fp8_blocks import FP8_BLOCK, dequantize_fp8_block
from common.model.fused_linear import fuse_projections
from common.model.hf_config import load_architecture
from common.model.host_embedding import host_table_owners
from common.model.int4_experts import Int4PublishedExperts
from common.model.int4_linears import dequantized_int4_source
from common.model.layers import activation
from common.model.ngram import ngram_shard_rows
from common.model.nvfp4_linears import dequantized_nvfp4_source
from common.model.provider import ExpertWeights
from common.model.published_experts import PublishedExperts, attach_published
from common.model.quantization import detect_quantization
from common.model.qwen4_exp.config import Qwen4ExpConfig
from common.model.registry import Architecture, ExpertKey, HostTableKey
from common.model.resident import ResidentExperts
from common.model.rope import RotaryEmbedding

log = logging.getLogger(__name__)


class _ExpertCollector:
    """Gathers per-expert or fused expert tensors of every MoE layer into stacked ExpertWeights."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.parts: dict[int, dict[tuple[int | None, str], torch.Tensor]] = defaultdict(dict)
        self.files: dict[tuple[int, int | None, str], Path] = {}  # where each part came from

    def add(self, ek: ExpertKey, tensor: torch.Tensor, path: Path, key: str) -> None:
        cfg = self.cfg
        if ek.layer not in cfg.moe_layers or (ek.expert is not None and ek.expert >= cfg.num_experts):
            raise CheckpointError("expert weight for a layer or expert the config does not have", path, key)
        check_shape(tensor, expert_shape(cfg, ek), path, key)
        _once(self.files, (ek.layer, ek.expert, ek.part), path, key)
        self.parts[ek.layer][(ek.expert, ek.part)] = tensor

    def finish(self, where: Path) -> dict[int, ExpertWeights]:
        out = {}
        for layer in self.cfg.moe_layers:
            parts = self.parts.get(layer, {})
            if (None, "gate_up") in parts and (None, "down") in parts:
                out[layer] = ExpertWeights(parts[(None, "gate_up")], parts[(None, "down")])
                continue
            gate_up, down = [], []
            for e in range(self.cfg.num_experts):
                for part in ("gate", "up", "down"):
                    if (e, part) not in parts:
                        raise CheckpointError(
                            "missing tensor",
                            where,
                            f"model.layers.{layer}.mlp.experts.{e}.{part}_proj.weight",
                        )
                gate_up.append(torch.cat([parts[(e, "gate")], parts[(e, "up")]], dim=0))
                down.append(parts[(e, "down")])
            out[layer] = ExpertWeights(torch.stack(gate_up), torch.stack(down))
            parts.clear()
        return out


def expert_shape(cfg: ModelConfig, ek: ExpertKey) -> tuple[int, ...]:
    """The shape of a routed expert's tensor in a checkpoint: one expert's part, or a layer's fused one."""
    h, i, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    expected = {"gate": (i, h), "up": (i, h), "down": (h, i), "gate_up": (e, 2 * i, h)}
    return expected[ek.part] if ek.expert is not None or ek.part == "gate_up" else (e, h, i)


class _TableCollector:
    """Fills each host table (e.g. PLE's n-gram table) shard by shard, without holding a second copy."""

    def __init__(self, model: nn.Module) -> None:
        self.owners = host_table_owners(model)
        self.rows: dict[str, torch.Tensor] = {}
        self.scales: dict[str, torch.Tensor] = {}
        self.seen: dict[str, dict[int, Path]] = defaultdict(dict)  # each table's shards, and their files
        self.example_key: dict[str, str] = {}

    def add(self, tk: HostTableKey, tensor: torch.Tensor, path: Path, key: str) -> None:
        owner = self.owners.get(tk.owner)
        rows, dim = owner.table_shape() if owner is not None else (0, 0)
        sizes = ngram_shard_rows(rows, owner.table_parts) if owner is not None else []
        if not 0 <= tk.shard < len(sizes):
            raise CheckpointError("table shard the config does not have", path, key)
        if tk.part == "scale":
            scales = self.scales.setdefault(tk.owner, torch.ones(len(sizes), device=tensor.device))
            scales[tk.shard] = tensor.float().reshape(-1)[0]
            return
        check_shape(tensor, (sizes[tk.shard], dim), path, key)
        _once(self.seen[tk.owner], tk.shard, path, key)
        table = self.rows.setdefault(
            tk.owner, torch.empty((rows, dim), dtype=tensor.dtype, device=tensor.device)
        )
        start = sizes[0] * tk.shard  # every shard but the last has sizes[0] rows
        table[start : start + sizes[tk.shard]] = tensor
        self.example_key[tk.owner] = key

    def finish(self, where: Path) -> None:
        from common.model.host_rows import HostRows

        for name, owner in self.owners.items():
            shards = len(ngram_shard_rows(owner.table_shape()[0], owner.table_parts))
            missing = sorted(set(range(shards)) - self.seen[name].keys())
            if missing:
                example = self.example_key.get(name, f"{name}.ple_embedding.ngram_embedding.shard_0.weight")
                raise CheckpointError(
                    "missing tensor", where, re.sub(r"shard_\d+", f"shard_{missing[0]}", example)
                )
            scales = self.scales.get(name)
            if self.rows[name].dtype == torch.float8_e4m3fn and scales is None:
                raise CheckpointError("fp8 table without weight_scale_inv", where, self.example_key[name])
            shard_rows = ngram_shard_rows(owner.table_shape()[0], owner.table_parts)[0]
            if not self.rows[name].is_meta:  # (a check of the headers only: `check_checkpoint`)
                owner.attach_table(HostRows(self.rows[name], scales, shard_rows))


def _once(seen: dict, target: object, path: Path, key: str) -> None:
    """Record that `target` came from `path`; CheckpointError naming both files if it came before (the later
    copy would win or lose by file order, whatever the index says)."""
    if target in seen:
        raise CheckpointError(
            f"tensor appears twice in the checkpoint (first in {seen[target].name})", path, key
        )
    seen[target] = path


# --- fp8 block-quantized checkpoints ------------------------------------------------------------------------

_Entry = tuple[Path, str, Callable[[], torch.Tensor]]


def _scaled_key(key: str) -> str | None:
    """The key that the block-scale tensor `key` scales, or None if `key` is no block scale.

    `X_scale_inv` scales `X` (HF FineGrainedFP8: `X.weight_scale_inv`; fused experts:
    `gate_up_proj_scale_inv`); `X.weight_scale` scales `X.weight` (the non-inverse name some exporters use for
    the same multiplier).
    """
    if key.endswith("_scale_inv"):
        return key.removesuffix("_scale_inv")
    if key.endswith(".weight_scale"):
        return key.removesuffix("_scale")
    return None


def _is_fp8(tensor: torch.Tensor) -> bool:
    return tensor.dtype.is_floating_point and tensor.dtype.itemsize == 1


def _read(entry: _Entry) -> torch.Tensor:
    path, key, read = entry
    try:
        return read()
    except CheckpointError:  # a reader that names its own file and key (an NVFP4 linear's scale)
        raise
    except Exception as exc:
        raise CheckpointError(f"cannot read tensor: {exc}", path, key) from exc


def _read_unscaled(entry: _Entry) -> torch.Tensor:
    """A tensor that has no block scale: an fp8 one would load as its raw codes, so it is an error."""
    tensor = _read(entry)
    if _is_fp8(tensor):
        raise CheckpointError(f"{tensor.dtype} tensor without its weight_scale_inv", entry[0], entry[1])
    return tensor


def _read_dequantized(weight: _Entry, scale: _Entry, block: int) -> torch.Tensor:
    """weight · scale of its block, formed in float32 and rounded once (as transformers dequantizes), so that
    the model dtype's cast is the only other rounding."""
    w, s = _read(weight), _read(scale)
    if not s.dtype.is_floating_point:  # e.g. MXFP8's uint8 exponents: not a multiplier as stored
        raise CheckpointError(f"block scale of dtype {s.dtype} is not supported", scale[0], scale[1])
    try:
        return dequantize_fp8_block(w, s, block, torch.float32)
    except ValueError as exc:  # the scale grid does not fit the weight
        raise CheckpointError(f"block scale does not fit its weight: {exc}", scale[0], scale[1]) from exc


def _pair_scales(entries: Iterable[_Entry], keep_quantized: Callable[[str], bool]) -> dict[str, _Entry]:
    """Weight key -> its block-scale entry; a scale whose weight is not in the checkpoint is an error."""
    keys = {key for _, key, _ in entries}
    scales: dict[str, _Entry] = {}
    for entry in entries:
        target = _scaled_key(entry[1])
        if target is None or keep_quantized(target):
            continue
        if target not in keys:
            raise CheckpointError(f"block scale without its weight {target!r}", entry[0], entry[1])
        if target in scales:
            raise CheckpointError(f"second block scale for {target!r}", entry[0], entry[1])
        scales[target] = entry
    return scales


def dequantized_fp8_source(
    source: TensorSource, block: int = FP8_BLOCK, keep_quantized: Callable[[str], bool] | None = None
) -> Iterator[_Entry]:
    """`source` with each block-quantized weight dequantized: `X` and its scale `X_scale_inv` (or
    `X.weight_scale`) become one entry under `X` whose reader returns fp8 · scale of its block×block block
    in float32; the scale keys are dropped. Any other fp8 tensor is a CheckpointError when read.

    The weight and its scale may sit in different shards, in either order, so the lazy readers are gathered
    first (no tensor is read here; each is read when the loader asks, a pair at a time). Keys for which
    `keep_quantized(key)` holds (a host table in its own fp8 format, e.g.) pass through untouched, with their
    scales.
    """
    keep = keep_quantized or (lambda key: False)
    entries = deque(source)
    scales = _pair_scales(entries, keep)
    paired = {scale[1] for scale in scales.values()}
    while entries:  # popped as yielded, so a file is unmapped once its last reader is dropped
        path, key, read = entry = entries.popleft()
        if key in scales:
            yield path, key, functools.partial(_read_dequantized, entry, scales.pop(key), block)
        elif key not in paired:
            yield path, key, read if keep(key) else functools.partial(_read_unscaled, entry)


def fp8_block_size(model_dir: str | Path) -> int:
    """The block of the checkpoint's fp8 scales: config.json's quantization_config.weight_block_size, which
    must be square (every released FP8 checkpoint uses [128, 128]); 128 when the config names none."""
    path = Path(model_dir) / "config.json"
    quant = read_json(path).get("quantization_config")
    size = quant.get("weight_block_size") if isinstance(quant, dict) else None
    if size is None:
        return FP8_BLOCK
    square = isinstance(size, list) and len(size) == 2 and size[0] == size[1]
    if not (square and isinstance(size[0], int) and size[0] > 0):
        key = "quantization_config.weight_block_size"
        raise CheckpointError(f"unsupported weight_block_size {size} (want [n, n])", path, key)
    return size[0]


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    with_mtp: bool = False,
    expert_device: torch.device | str | None = None,
    fuse: bool = False,
    published_only: bool = False,
) -> nn.Module:
    """Build the model of `model_dir` on `device` in `dtype` and fill it from the checkpoint (FP8
    block-quantized weights dequantized, see `dequantized_fp8_source`; the PLE n-gram table keeps its own
    fp8 format; NVFP4 / MXFP4 experts kept in their bits as well as dequantised: `attach_published`). The
    checkpoint's quantization is checked first (common/model/quantization.py).

    `with_mtp` also builds and loads the checkpoint's MTP head (for speculative decoding). `expert_device`
    (default `device`) is where the routed experts are read to: `cpu` for a model whose experts go to a
    host store next, so that they never pass through the device (they may not fit there). `fuse`: same-input
    projections as one weight each (see `empty_model`). `published_only`: NVFP4 / MXFP4 experts kept in
    their bits only, not dequantised too (a model whose experts go to a host store next).
    """
    arch, cfg = load_architecture(model_dir)
    if with_mtp:
        if not (isinstance(cfg, Qwen4ExpConfig) and cfg.checkpoint_mtp_layers):
            raise CheckpointError("the checkpoint has no MTP head", Path(model_dir) / "config.json")
        cfg = dataclasses.replace(cfg, mtp_layers=cfg.checkpoint_mtp_layers)
    where = Path(model_dir) / INDEX_FILE
    source, published = model_source(model_dir, arch, cfg, safetensors_source(model_dir))
    if published is not None:
        model = build_model(arch, cfg, source, where, dtype, device, external_experts=True, fuse=fuse)
        attach_published(model, published, where, dtype, None if published_only else expert_device or device)
        return model
    if (Path(model_dir) / ARTIFACT_META).is_file():
        if with_mtp:
            raise CheckpointError(
                "speculative decoding from a converted artifact is not supported yet",
                Path(model_dir) / ARTIFACT_META,
            )
        return build_model(arch, cfg, source, where, dtype, device, external_experts=True, fuse=fuse)
    where = where if where.is_file() else Path(model_dir)
    return build_model(arch, cfg, source, where, dtype, device, expert_device=expert_device, fuse=fuse)


def model_source(
    model_dir: str | Path, arch: Architecture, cfg: ModelConfig, raw: TensorSource
) -> tuple[TensorSource, PublishedExperts | None]:
    """`raw` (the checkpoint's tensors) as `build_model` takes them: quantized linears dequantised, and
    published routed experts (NVFP4, MXFP4, GPTQ, AWQ, compressed-tensors) taken out into the
    PublishedExperts returned (None for another scheme, or an artifact), and the family's own layouts made
    the runtime's (`Architecture.adapt_source`). The quantization is checked first: an unsupported method
    stops here."""
    scheme = detect_quantization(model_dir)
    published = None
    if scheme.expert_format is not None and not (Path(model_dir) / ARTIFACT_META).is_file():
        if scheme.ct is not None:
            kind: type[PublishedExperts] = CtPublishedExperts
        else:
            kind = Int4PublishedExperts if scheme.int4_format else PublishedExperts
        published = kind(scheme.expert_format, arch, cfg, Path(model_dir) / "config.json")
        raw = published.filter(raw)
    if scheme.method == "nvfp4":
        raw = dequantized_nvfp4_source(raw)  # linears outside the routed experts
    if scheme.ct is not None:  # linears outside the routed experts
        raw = dequantized_ct_source(raw, scheme.ct, linear_dims(arch, cfg))
    elif scheme.int4_format:
        dims = linear_dims(arch, cfg)
        raw = dequantized_int4_source(raw, scheme.int4_format, lambda k: dims(k.removesuffix(".weight")))
    source: TensorSource = dequantized_fp8_source(
        raw,
        fp8_block_size(model_dir),
        keep_quantized=lambda key: isinstance(arch.map_key(key, cfg), HostTableKey),
    )
    if arch.adapt_source is not None:  # the family's own layouts, once every tensor is plain
        source = arch.adapt_source(source, cfg)
    return source, published


def check_checkpoint(model_dir: str | Path) -> None:
    """Make every check `load_model` makes of the model's files and read no tensor: each safetensors file
    opened (`header_source`: its header readable, its tensors' bytes within it), then the model built on
    the meta device from the tensors' headers (every tensor the config asks for present, each of its shape,
    a weight floating-point, quantized weights with their scales, published experts complete).
    CheckpointError naming the file and key."""
    arch, cfg = load_architecture(model_dir)
    source, published = model_source(model_dir, arch, cfg, header_source(model_dir))
    external = published is not None or (Path(model_dir) / ARTIFACT_META).is_file()
    where = Path(model_dir) / INDEX_FILE
    where = where if where.is_file() else Path(model_dir)
    build_model(arch, cfg, source, where, torch.float32, "meta", external_experts=external)
    if published is not None:
        published.layers(where)


class BuiltModel(Protocol):
    """What `empty_model` finishes on the module an architecture builds."""

    rotary: RotaryEmbedding

    def tie_weights(self) -> None: ...


def empty_model(
    arch: Architecture,
    cfg: ModelConfig,
    experts: ResidentExperts,
    dtype: torch.dtype,
    device: torch.device | str,
    fuse: bool = False,
) -> nn.Module:
    """`arch` for `cfg` with uninitialised weights in `dtype` on `device` (`meta`: no memory at all), the
    buffers computed rather than loaded (in float32, e.g. RoPE's inverse frequencies) and embeddings tied.
    With `fuse` each module's same-input projections are one weight from the start (fused_linear.py): their
    Linears' weights are views of it, so loading fills it and no memory is freed or held twice."""
    with torch.device("meta"), _no_init():
        model = arch.build(cfg, experts).to(dtype)
    if fuse:
        fuse_projections(model)  # on the meta device: shapes only
    _materialize(model, torch.device(device))
    if fuse:
        fuse_projections(model, copy=False)  # the fused weights, now on the device (views, no copy)
    built = cast(BuiltModel, model)
    built.rotary.init_buffers()
    built.tie_weights()
    return model


_INITS = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "xavier_uniform_", "zeros_", "ones_")


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """torch.nn's modules built without initialising their parameters (on the meta device, loaded or mapped
    after): `normal_` on the meta device alone imports torch._dynamo, seconds of a worker's start."""
    saved = {name: getattr(nn.init, name) for name in _INITS}
    for name in _INITS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, init in saved.items():
            setattr(nn.init, name, init)


@functools.lru_cache(maxsize=8)
def meta_model(arch: Architecture, cfg: ModelConfig, dtype: torch.dtype) -> nn.Module:
    """The model on the meta device, as `build_model` builds it (float32 buffers in a bf16 model included):
    its parameters' shapes and sizes, no memory."""
    return empty_model(arch, cfg, ResidentExperts({}, activation(cfg.hidden_act)), dtype, "meta")


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Give `model`'s meta parameters and buffers uninitialised memory on `device`, one allocation per meta
    storage: parameters that are views of one tensor (fused projections) stay views of one tensor."""
    if device.type == "meta":
        return
    storages: dict[int, torch.UntypedStorage] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None:
                continue
            meta = param.untyped_storage()
            if meta._cdata not in storages:
                storages[meta._cdata] = torch.UntypedStorage(meta.nbytes(), device=device)
            real = torch.empty(0, dtype=param.dtype, device=device).set_(
                storages[meta._cdata], param.storage_offset(), param.shape, param.stride()
            )
            module._parameters[name] = nn.Parameter(real, requires_grad=param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = torch.empty_like(buffer, device=device)


def build_model(
    arch: Architecture,
    cfg: ModelConfig,
    source: TensorSource,
    where: Path,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    external_experts: bool = False,
    expert_device: torch.device | str | None = None,
    fuse: bool = False,
) -> nn.Module:
    """Build `arch` for `cfg` and fill it from `source` (a checkpoint, or tensors generated in memory).

    `where` names the checkpoint in errors about tensors that are missing altogether. With
    `external_experts` the routed experts come from elsewhere (an artifact's packed store); otherwise they
    are read to `expert_device` (default `device`). `fuse`: see `empty_model`.
    """
    experts = ResidentExperts({}, activation(cfg.hidden_act))
    model = empty_model(arch, cfg, experts, dtype, device, fuse)
    params = dict(model.named_parameters())  # a tied lm_head appears once, as the embedding
    loaded: dict[str, Path] = {}  # target → the file it came from
    collector = _ExpertCollector(cfg)
    tables = _TableCollector(model)
    unexpected: list[str] = []
    for path, key, read in source:
        target = arch.map_key(key, cfg)
        if target is None:  # a key the architecture deliberately leaves out (e.g. an MTP head not asked for)
            continue
        if isinstance(target, str) and target not in params:
            unexpected.append(key)
            continue
        try:
            tensor = read()
        except CheckpointError:  # a reader that names its own file and key (e.g. an fp8 weight's scale)
            raise
        except Exception as exc:
            raise CheckpointError(f"cannot read tensor: {exc}", path, key) from exc
        if isinstance(target, ExpertKey):
            check_weight(tensor, path, key)
            collector.add(target, tensor.to(device=expert_device or device, dtype=dtype), path, key)
        elif isinstance(target, HostTableKey):
            tables.add(target, tensor, path, key)  # stays in host memory, in its stored dtype
        else:
            check_weight(tensor, path, key)
            check_shape(tensor, tuple(params[target].shape), path, key)
            _once(loaded, target, path, key)
            with torch.no_grad():
                params[target].copy_(tensor)
    missing = sorted(set(params) - loaded.keys())
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing tensor{more}", where, missing[0])
    if not external_experts:
        experts.weights = collector.finish(where)
    tables.finish(where)
    if unexpected:
        log.warning(
            "ignored %d checkpoint keys the runtime does not use, e.g. %s", len(unexpected), unexpected[0]
        )
    return model.eval()
