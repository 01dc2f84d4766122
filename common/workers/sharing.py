"""What decode exports and prefill maps (docs/ARCHITECTURE.md, Memory): one copy of each, owned by decode.

Export names: `weights.{parameter or buffer}`; `experts.{layer}.{gate_up|down}` (resident experts);
`state.{layer}.{name}` (state pools); `tables.{module}.rows|scales` (host tables: the n-gram table); with
offloaded experts `experts.store` (the host expert store, unless it is an artifact's file, which prefill
maps itself), `cache.pool.{component}` and `cache.slot_of` (the expert cache, which prefill reads in place
while decode keeps it frozen).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from common.config import WorkerConfig
from common.engine.memory_plan import DTYPES
from common.experts.artifact import open_store
from common.experts.cache_tables import CacheTables
from common.experts.formats import get_format
from common.experts.offload import OffloadedExperts
from common.experts.routing import install_routing_hook, replayer_for
from common.experts.store import HostExpertStore
from common.ipc import tensors as ipc
from common.model.fp8_linear import quantize_resident
from common.model.fused_linear import fuse_projections
from common.model.hf_config import load_architecture
from common.model.host_embedding import embeddings_to_host, host_table_owners
from common.model.host_rows import HostRows
from common.model.layers import activation
from common.model.loader import empty_model
from common.model.moe import install_provider
from common.model.ngram import ngram_shard_rows
from common.model.provider import ExpertWeights
from common.model.resident import ResidentExperts
from common.protocol import Exports, SharedTensor
from common.workers.decode import DecodeCore


def shared_allocator(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed tensor another process can map (state pools)."""
    return ipc.shared_empty(shape, dtype, device).zero_()


def _shareable(t: torch.Tensor) -> torch.Tensor:
    if ipc.is_exportable(t):
        return t
    return ipc.shared_empty(t.shape, t.dtype, t.device).copy_(t)


def decode_exports(core: DecodeCore) -> Exports:
    """Move decode's weights into exportable memory (a no-op on CUDA) and export them with the pools."""
    model = core.engine.model
    tensors = {f"weights.{k}": v for k, v in ipc.share_module(model).items()}
    # On the CPU sharing copies each weight into its own segment: fused projections, no longer back to back,
    # would keep the old fused copy alive; re-deriving them keeps those still adjacent (all, on CUDA).
    fuse_projections(model, copy=False)
    experts = model.experts
    if isinstance(experts, ResidentExperts):
        for layer, w in experts.weights.items():
            w.gate_up, w.down = _shareable(w.gate_up), _shareable(w.down)
            tensors[f"experts.{layer}.gate_up"] = ipc.export_tensor(w.gate_up)
            tensors[f"experts.{layer}.down"] = ipc.export_tensor(w.down)
    else:
        assert isinstance(experts, OffloadedExperts)  # the one other provider
        tensors.update(_offload_exports(experts))
    for key, t in core.pool.named_tensors().items():
        tensors[f"state.{key}"] = ipc.export_tensor(t)
    tensors.update(_table_exports(model))
    offloaded = experts if isinstance(experts, OffloadedExperts) else None
    return Exports(
        epoch=os.getpid(),
        tensors=tensors,
        page_size=core.pool.page_size,
        max_context=core.runner.max_context,
        expert_format=offloaded.fmt.name if offloaded is not None else "",
        arena_row=int(offloaded.tables.bank[0]) if offloaded is not None and core.cfg.lend_arena else -1,
    )


def _offload_exports(offload: OffloadedExperts) -> dict[str, SharedTensor]:
    out = {}
    if ipc.is_exportable(offload.store.buffer):  # else an artifact's mapped file
        out["experts.store"] = ipc.export_tensor(offload.store.buffer)
    for name in offload.pool:
        offload.pool[name] = _shareable(offload.pool[name])  # in place: the copy stream holds the dict
        out[f"cache.pool.{name}"] = ipc.export_tensor(offload.pool[name])
    offload.tables.slot_of = _shareable(offload.tables.slot_of)
    out["cache.slot_of"] = ipc.export_tensor(offload.tables.slot_of)
    return out


def _table_exports(model: nn.Module) -> dict[str, SharedTensor]:
    """Host tables move into shared memory (re-attached, so the GPU registration follows) and are exported."""
    out = {}
    for name, owner in host_table_owners(model).items():
        table = owner.table
        assert table is not None  # attached at load
        rows = _shareable(table.rows)
        if rows is not table.rows:
            owner.attach_table(HostRows(rows, table.shard_scales, table.shard_rows))
        out[f"tables.{name}.rows"] = ipc.export_tensor(rows)
        if table.shard_scales is not None:
            out[f"tables.{name}.scales"] = ipc.export_tensor(_shareable(table.shard_scales))
    return out


def _attach_tables(model: nn.Module, imported: dict[str, torch.Tensor]) -> None:
    for name, owner in host_table_owners(model).items():
        shard_rows = ngram_shard_rows(owner.table_shape()[0], owner.table_parts)[0]
        scales = imported.get(f"tables.{name}.scales")
        owner.attach_table(HostRows(imported[f"tables.{name}.rows"], scales, shard_rows))


def host_allocator(nbytes: int) -> torch.Tensor:
    """Host memory for the expert store that prefill can map too."""
    return ipc.shared_empty((nbytes,), torch.uint8, "cpu")


def _prefill_experts(cfg: WorkerConfig, mcfg, exports: Exports, imported: dict[str, torch.Tensor]):
    """Prefill's provider over decode's expert store and (frozen) cache: an arena of its own, or with
    `--lend-arena` rows of decode's pool (`Exports.arena_row`)."""
    layers = sorted(mcfg.moe_layers)
    fmt = get_format(exports.expert_format)
    if "experts.store" in imported:
        components = fmt.components(mcfg.hidden_size, mcfg.moe_intermediate_size)
        store = HostExpertStore(
            len(layers), mcfg.num_experts, components, allocate=lambda n: imported["experts.store"]
        )
    else:
        store, _ = open_store(cfg.model_dir)
    pool = {k[len("cache.pool.") :]: v for k, v in imported.items() if k.startswith("cache.pool.")}
    tables = CacheTables(len(layers), mcfg.num_experts, [0] * len(layers), device=cfg.device)
    return OffloadedExperts(
        store,
        tables,
        fmt,
        activation(mcfg.hidden_act),
        layers,
        cfg.device,
        DTYPES[cfg.model_dtype],
        shared_cache=(pool, imported["cache.slot_of"]),
        arena_row=exports.arena_row if exports.arena_row >= 0 else None,
    )


def prefill_model(cfg: WorkerConfig, exports: Exports) -> tuple[nn.Module, dict[str, torch.Tensor], tuple]:
    """Build the model on decode's exported weights: (model, state pool tensors by key, eos token ids)."""
    arch, mcfg = load_architecture(cfg.model_dir)
    imported = ipc.import_tensors(exports.tensors)
    experts = ResidentExperts({}, activation(mcfg.hidden_act))
    model = empty_model(arch, mcfg, experts, DTYPES[cfg.model_dtype], "meta")
    if cfg.embeddings_on_host:  # decode exports the rows as a host table
        embeddings_to_host(model)
    if cfg.resident_dtype is not None:  # decode's quantised modules, on the meta device: shapes to map
        quantize_resident(model)
    ipc.attach_module(model, {k[8:]: v for k, v in imported.items() if k.startswith("weights.")})
    if "cache.slot_of" in imported:
        install_provider(model, _prefill_experts(cfg, mcfg, exports, imported))
    else:
        for layer in mcfg.moe_layers:
            experts.weights[layer] = ExpertWeights(
                imported[f"experts.{layer}.gate_up"], imported[f"experts.{layer}.down"]
            )
    _attach_tables(model, imported)
    if cfg.replay_routing:
        layers = sorted(mcfg.moe_layers)
        install_routing_hook(model, replayer_for(cfg.replay_routing, layers, mcfg.num_experts, mcfg.top_k))
    pools = {k[6:]: v for k, v in imported.items() if k.startswith("state.")}
    return model.eval(), pools, tuple(mcfg.eos_token_ids)
