"""OffloadedExperts: routed experts in host memory, served by the VRAM cache (decode) or an arena (prefill).

Decode passes resolve each layer's experts against the cache tables (hits read their slot; admitted misses
are copied into their victim's slot first; bypassed misses read host memory). Prefill passes use the arena:
experts already cached are read in place (without touching the cache's statistics) and the rest are copied
in one batch into the arena. Either way every expert's weights are the same bytes and the computation visits
experts in the same order, so the output does not depend on the cache's size, policy or contents.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from common.experts.cache_tables import DEFAULT_POLICY, CacheTables
from common.experts.formats import get_format
from common.experts.provider import ExpertProvider, install_provider
from common.experts.resident import grouped_expert_mlp
from common.experts.store import HostExpertStore
from common.model.hf_config import read_json


@dataclass
class TrafficCounters:
    """Bytes moved host → device, per MoE layer (host-side ints, summed from the step's fills)."""

    cache_bytes: list[int]
    arena_bytes: list[int]
    arena_loads: list[int]


class PrefillArena:
    """Double-buffered staging for the experts a prefill chunk needs that the cache does not hold."""

    def __init__(self, store: HostExpertStore, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.buffers = [
            {
                name: torch.empty((capacity, *shape), dtype=dtype, device=device)
                for name, (shape, dtype) in store.components.items()
            }
            for _ in range(2)
        ]
        self.turn = 0

    def load(self, store: HostExpertStore, layer: int, experts: torch.Tensor) -> dict[str, torch.Tensor]:
        """Copy `experts` ([n] ids, n ≤ capacity) of `layer` into the next buffer; return [n, ...] views."""
        buffer = self.buffers[self.turn]
        self.turn ^= 1  # the other buffer stays intact while this one is (re)filled
        n = experts.numel()
        host = experts.to(store.buffer.device)
        for name, block in store.parts[layer].items():
            buffer[name][:n].copy_(block.index_select(0, host), non_blocking=True)
        return {name: t[:n] for name, t in buffer.items()}


class OffloadedExperts(ExpertProvider):
    """The expert provider of a model whose routed experts live in a HostExpertStore."""

    def __init__(
        self,
        store: HostExpertStore,
        tables: CacheTables,
        unpack: Callable[[dict[str, torch.Tensor], torch.dtype], tuple[torch.Tensor, torch.Tensor]],
        act: Callable[[torch.Tensor], torch.Tensor],
        moe_layers: list[int],
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        self.store, self.tables, self.unpack, self.act = store, tables, unpack, act
        self.device, self.dtype = torch.device(device), dtype
        self.index = {layer: i for i, layer in enumerate(moe_layers)}
        self.pool = {
            name: torch.empty((tables.num_slots + 1, *shape), dtype=dtype, device=self.device)
            for name, (shape, dtype) in store.components.items()
        }
        for layer, slots in enumerate(tables.layer_slots):  # pinned experts are filled once, at load
            pinned = slots[tables.pinned[slots]]
            if pinned.numel():
                self._copy_into_slots(layer, tables.owner[pinned], pinned)
        self.arena = PrefillArena(store, store.num_experts, self.device)
        n = len(moe_layers)
        self.traffic = TrafficCounters([0] * n, [0] * n, [0] * n)
        self.prefill = False
        self.step = self.decode_passes = 0

    rebalance_every = 256
    """Decode passes between two per-layer capacity adjustments (host-side, between steps)."""

    def begin_pass(self, is_decode: bool) -> None:
        """Called by the runner before each forward: decode passes use the cache, others the arena; every
        `rebalance_every` decode passes, slots move from the layer with the best hit rate to the worst."""
        self.prefill = not is_decode
        self.step += 1
        if is_decode:
            self.decode_passes += 1
            if self.decode_passes % self.rebalance_every == 0:
                per_layer = self.tables.num_slots // self.tables.num_layers
                self.tables.rebalance(slots_to_move=max(1, per_layer // 16))

    def forward(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        i = self.index[layer]
        requested = torch.zeros(self.store.num_experts, dtype=torch.bool, device=topk_ids.device)
        requested[topk_ids.reshape(-1)] = True
        weights_of = (
            self._arena_weights(i, requested) if self.prefill else self._cache_weights(i, requested, topk_ids)
        )
        return grouped_expert_mlp(x, weights_of, topk_ids, topk_weights, self.act)

    def _cache_weights(self, i: int, requested: torch.Tensor, topk_ids: torch.Tensor):
        res = self.tables.resolve(
            i, requested, self.step, max_new=min(topk_ids.numel(), self.store.num_experts)
        )
        fills = res.filled.nonzero().squeeze(1)
        if fills.numel():
            self._copy_into_slots(i, fills, res.slot[fills])
            self.traffic.cache_bytes[i] += fills.numel() * self.store.expert_bytes
        slot = res.slot.tolist()

        def weights_of(e: int) -> tuple[torch.Tensor, torch.Tensor]:
            if slot[e] >= 0:
                parts = {name: t[slot[e]] for name, t in self.pool.items()}
            else:  # bypass: straight from host memory
                parts = {name: t.to(self.device) for name, t in self.store.expert(i, e).items()}
            return self.unpack(parts, self.dtype)

        return weights_of

    def _arena_weights(self, i: int, requested: torch.Tensor):
        slot_of = self.tables.slot_of[i, : self.store.num_experts]  # a read-only peek: no statistics
        cached = requested & (slot_of >= 0)
        missing = (requested & ~cached).nonzero().squeeze(1)
        staged = self.arena.load(self.store, i, missing) if missing.numel() else {}
        self.traffic.arena_bytes[i] += missing.numel() * self.store.expert_bytes
        self.traffic.arena_loads[i] += int(missing.numel() > 0)
        slot = torch.where(cached, slot_of, -1).tolist()
        position = {e: j for j, e in enumerate(missing.tolist())}

        def weights_of(e: int) -> tuple[torch.Tensor, torch.Tensor]:
            source = (
                {n: t[slot[e]] for n, t in self.pool.items()}
                if slot[e] >= 0
                else {n: t[position[e]] for n, t in staged.items()}
            )
            return self.unpack(source, self.dtype)

        return weights_of

    def _copy_into_slots(self, i: int, experts: torch.Tensor, slots: torch.Tensor) -> None:
        host = experts.to(self.store.buffer.device)
        for name, block in self.store.parts[i].items():
            self.pool[name][slots.to(self.device)] = block.index_select(0, host).to(
                self.device, non_blocking=True
            )


def parse_capacity(spec: str, num_layers: int, num_experts: int) -> list[int]:
    """`--expert-cache` → slots per MoE layer: `all`, a fraction of each layer's experts (`0.3`), or a total
    slot count split evenly (`1500`). At least one slot per layer."""
    if spec == "all":
        return [num_experts] * num_layers
    try:
        value = float(spec)
    except ValueError as exc:
        raise ValueError(f"--expert-cache must be SLOTS, FRACTION or all, not {spec!r}") from exc
    if "." in spec:
        if not 0 < value <= 1:
            raise ValueError(f"--expert-cache fraction {spec} must be in (0, 1]")
        return [max(1, min(num_experts, round(value * num_experts)))] * num_layers
    total = int(value)
    if total < num_layers:
        raise ValueError(f"--expert-cache {total} slots is fewer than one per MoE layer ({num_layers})")
    base, extra = divmod(min(total, num_layers * num_experts), num_layers)
    return [min(num_experts, base + (i < extra)) for i in range(num_layers)]


def offload_experts(
    model: torch.nn.Module,
    capacity: str,
    policy: str = DEFAULT_POLICY,
    fmt: str = "bf16",
    pinned: dict[int, list[int]] | None = None,
    store: HostExpertStore | None = None,
) -> OffloadedExperts:
    """Serve `model`'s routed experts from a host store through a VRAM cache of `capacity` (see
    parse_capacity) under `policy`; `pinned` maps MoE layer index → hot experts. Without `store` the model's
    resident experts are packed into a new one in format `fmt` (and freed); with it (an artifact's), used."""
    resident = model.experts
    cfg = model.config
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    layers = sorted(cfg.moe_layers)
    form = get_format(fmt)
    if store is None:
        store = HostExpertStore(
            len(layers), cfg.num_experts, form.components(cfg.hidden_size, cfg.moe_intermediate_size)
        )
        for i, layer in enumerate(layers):
            w = resident.weights.pop(layer)  # free each resident layer as it is packed
            store.fill(i, [form.pack(w.gate_up[e].cpu(), w.down[e].cpu()) for e in range(cfg.num_experts)])
    elif store.num_layers != len(layers) or store.num_experts != cfg.num_experts:
        raise ValueError(
            f"expert store of {store.num_layers}×{store.num_experts}, model has "
            f"{len(layers)}×{cfg.num_experts}"
        )
    tables = CacheTables(
        len(layers),
        cfg.num_experts,
        parse_capacity(capacity, len(layers), cfg.num_experts),
        policy,
        device,
        pinned=pinned,
    )
    provider = OffloadedExperts(store, tables, form.unpack, resident.act, layers, device, dtype)
    install_provider(model, provider)
    return provider


def load_hot_set(path: str | Path) -> dict[int, list[int]]:
    """A calibration hot set: JSON `{"MoE layer index": [expert ids]}` (say, a trace's most used experts)."""
    data = read_json(Path(path))
    try:
        return {int(layer): [int(e) for e in experts] for layer, experts in data.items()}
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: expected {{layer: [expert ids]}}: {exc}") from exc
