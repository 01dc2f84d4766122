"""Prefill passes through the arena: two buffers of E pool rows used by alternate MoE layers. A small chunk
reads the experts already cached in place (without touching the cache's statistics) and copies the others
into the layer's buffer after routing. A chunk big enough that every MoE layer will almost surely need every
expert (T·k ≥ 4·E: an expert is unused with probability e^(−T·k/E) < 2 %) streams whole layers instead, by
DMA into the two buffers in turn, each launched while the layer before computes, and reads nothing from the
cache. Scratch is bounded by the tokens of one MoE call, not by how many experts it uses: on the torch path
experts are computed one at a time (T·(2H + 3I) activations plus one dequantised expert, 3·H·I, at once)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.experts.cache_tables import CacheTables
from common.experts.copies import Copies, CopyStream
from common.experts.formats import ExpertFormat
from common.experts.paths import ExpertPath, KernelSwitches, Prepared, check_group, chosen
from common.experts.store import HostExpertStore
from common.experts.traffic import ARENA, LOADS
from common.model.provider import add_shared
from common.model.resident import grouped_expert_mlp

SharedCache = tuple[dict[str, torch.Tensor], torch.Tensor]
"""Another provider's (pool, slot_of [L, E + 1]): decode's cache, mapped, read in place while frozen."""


def prefill_arena_rows(experts: int) -> int:
    """Pool rows a prefill pass needs beside any cache: a spare row and two arena buffers of E rows."""
    return 1 + 2 * experts


class PrefillArena:
    """Two buffers of E rows inside the pool, used by alternate MoE layers, so the next layer's experts can be
    copied while this layer computes; remembers which layers' copies are under way (within one pass)."""

    prefetch_factor = 4
    """Stream whole layers, each while the layer before computes, when a pass's MoE call has T·k ≥ this × E
    (a chunk, or a layer-major group's chunks together)."""

    def __init__(self, bases: list[int], num_experts: int, device: torch.device) -> None:
        """`bases`: the first pool row of each buffer (one or two)."""
        self.bases, self.num_experts, self.buffers = bases, num_experts, len(bases)
        self.ids = torch.arange(num_experts, device=device)  # [E]
        self.loaded: dict[int, Copies] = {}
        """MoE layer index → the copy of that whole layer into its buffer (launched; at most the two layers
        the buffers hold: a layer's copy evicts the one two layers before it)."""

    def rows(self, i: int) -> torch.Tensor:
        """[E] pool rows of MoE layer i's buffer (expert e at row e of the buffer)."""
        return self.bases[i % self.buffers] + self.ids

    def should_prefetch(self, choices: int) -> bool:
        return self.buffers == 2 and choices >= self.prefetch_factor * self.num_experts


class GroupedKernels:
    """A prefill pass's routed experts: the grouped int4 kernels (`fused_int4_prefill`), the grouped dense
    kernels for the other formats they read (`fused_dense_prefill`), else torch, one expert at a time
    (`grouped_expert_mlp`), each read from this pool or, where `Prepared.cached` says so, from the shared
    cache's."""

    def __init__(
        self,
        pool: dict[str, torch.Tensor],
        copies: CopyStream,
        fmt: ExpertFormat,
        act: Callable[[torch.Tensor], torch.Tensor],
        dtype: torch.dtype,
        switches: KernelSwitches,
        shared_cache: SharedCache | None,
    ) -> None:
        self.pool, self.copies, self.fmt, self.act, self.dtype = pool, copies, fmt, act, dtype
        self.switches, self.shared_cache = switches, shared_cache

    def compute(
        self,
        prepared: Prepared,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        shared: torch.Tensor | None,
        shared_gate: torch.Tensor | None,
        settled: bool,
    ) -> torch.Tensor:
        return add_shared(self._routed(prepared, x, topk_ids, topk_weights), shared, shared_gate)

    def _routed(
        self, prepared: Prepared, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        if self.switches.fused_int4_prefill:
            from common.kernels.moe_int4_grouped import moe_int4_grouped  # Triton

            self.copies.join(prepared.done)
            return moe_int4_grouped(x, topk_ids, topk_weights, prepared.rows, self.pool)
        if self.switches.fused_dense_prefill and self.fmt.dense_prefill:
            from common.kernels.moe_dense_grouped import moe_dense_grouped  # Triton

            self.copies.join(prepared.done)
            param = self.fmt.kernel_param
            return moe_dense_grouped(x, topk_ids, topk_weights, prepared.rows, self.pool, param=param)
        row = prepared.rows.tolist()  # prefill is not captured; read before waiting for the copies
        shared = self.shared_cache[0] if self.shared_cache is not None else None
        cached = prepared.cached.tolist() if shared is not None and prepared.cached is not None else None
        self.copies.join(prepared.done)

        def weights_of(e: int) -> tuple[torch.Tensor, torch.Tensor]:
            pool = shared if shared is not None and cached is not None and cached[e] else self.pool
            return self.fmt.unpack({n: t[row[e]] for n, t in pool.items()}, self.dtype)

        return grouped_expert_mlp(x, weights_of, topk_ids, topk_weights, self.act)


class ArenaPrefill(ExpertPath):
    """Prefill passes (and every pass of a provider over a shared cache) through the arena; a prompt's
    routing is counted in the cache statistics while `observing`."""

    def __init__(
        self,
        store: HostExpertStore,
        tables: CacheTables,
        copies: CopyStream,
        arena: PrefillArena,
        kernels: GroupedKernels,
        moved: torch.Tensor,
        num_layers: int,
    ) -> None:
        """`moved`: the traffic counters ([TRAFFIC_ROWS, L]); `num_layers`: L, the MoE layers."""
        super().__init__(kernels)
        self.store, self.tables, self.copies, self.arena, self.moved = store, tables, copies, arena, moved
        self.num_layers = num_layers
        self.shared_cache = kernels.shared_cache
        self.observing = False
        """This pass is a prompt's: its routing is counted in the cache statistics (`CacheTables.observe`;
        decode's rates start from it, a prefill worker's through PrefillDone.routing)."""

    def begin(self, prompt: bool) -> None:
        self.observing = prompt

    def prepare(self, i: int, topk_ids: torch.Tensor, group: int, groups: int) -> Prepared:
        """Big chunks (T·k ≥ prefetch_factor · E): whole layers into alternate buffers by DMA, the next
        layer's launched now so that it streams while this one computes; the cache is not read. Smaller
        chunks: cached experts in place (a read-only peek: no statistics), the others copied into the
        layer's buffer after routing."""
        e = self.store.num_experts
        check_group(topk_ids, e, groups)
        requested = chosen(topk_ids, e)
        if self.observing:
            self.tables.observe(i, topk_ids)
        if self.arena.should_prefetch(topk_ids.numel()):
            done = self._arena_layer(i)  # launched by the layer before (or now, for the first)
            if i + 1 < self.num_layers:
                self._arena_layer(i + 1)
            return Prepared(rows=self.arena.rows(i), done=done)
        table = self.shared_cache[1] if self.shared_cache is not None else self.tables.slot_of
        slot_of = table[i, :e]  # [E]
        cached = slot_of >= 0
        need = requested & ~cached
        done = self.copies.launch(i, self.arena.ids, self.arena.rows(i), need)
        self.moved[ARENA, i].add_(need.sum())
        self.moved[LOADS, i].add_(need.any())
        return Prepared(rows=torch.where(cached, slot_of, self.arena.rows(i)), done=done, cached=cached)

    def _arena_layer(self, i: int) -> Copies:
        """The copy of MoE layer i's experts into its buffer: the one under way, or a new one."""
        loaded = self.arena.loaded
        if i not in loaded:
            loaded.pop(i - self.arena.buffers, None)  # the layer whose buffer this overwrites
            loaded[i] = self.copies.launch_layer(i, self.arena.bases[i % self.arena.buffers])
            self.moved[ARENA, i].add_(self.store.num_experts)
            self.moved[LOADS, i].add_(1)
        return loaded[i]
