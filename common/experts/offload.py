"""OffloadedExperts: routed experts in host memory, served by the VRAM cache (decode) or an arena (prefill).

The pool. One device tensor per weight component, one expert a row: rows [0, S) are the cache's slots, row S
is a spare row (it absorbs the writes of invalid copies and stands for unrequested experts), and two arena
buffers of E rows follow, buffer b at rows S+1+b·E+e (expert e of the layer it serves). The first buffer
doubles as decode's staging rows: a bypassed miss (see `CacheTables`) is copied there for one step.

Decode passes resolve each layer's experts against the cache tables (device ops, fixed shapes): hits read
their slot; admitted misses are copied into their victim's slot, bypassed misses into a staging row, by one
fixed-shape copy launch ([P] pairs, P = min(T·k, E), padding skipped). Every chosen (token, choice) then
reads its expert's row and `batched_expert_mlp` computes all of them at once: no host sync, no loop over
experts. Prefill passes use the arena. A small chunk reads the experts already cached in place (without
touching the cache's statistics) and copies the others into the layer's arena buffer after routing. A chunk
big enough that every MoE layer will almost surely need every expert (T·k ≥ 4·E: an expert is unused with
probability e^(−T·k/E) < 2 %) streams whole layers instead, by DMA into the two buffers in turn, each
launched while the layer before computes, and reads nothing from the cache. Prefill computes with
`grouped_expert_mlp` (or, for int4 on CUDA, the grouped kernels).

Streams. With a GPU-mapped store on CUDA the copies run on a side stream: forked from the main stream once
the copy list is resolved, joined right before the weights are read, so they overlap with the main stream's
work in between — the next layer's stream with this layer's compute; the shared expert, when the MoE block
runs it between `prepare` and `compute` (see `ExpertProvider.prepare`). Elsewhere the copies run inline.

Memory bound. The pool is (S + 1 + 2·E) rows of one expert each. Prefill's scratch is bounded by the tokens
of one MoE call (a chunk, or a layer-major group's chunks together), not by how many experts it uses: on the
torch path experts are computed one at a time, so T tokens need at most
T·(2H + 3I) activations (an expert's rows of x, gate_up's output, the activated product and y) plus one
dequantised expert (3·H·I) at once, in the activation dtype — e.g. T = 8192, H = 2048, I = 512 in bf16:
~92 MB + 6 MB. Decode gathers its T·k chosen experts dequantised at once (T·k·3·H·I), which is why the
batched path is for decode-sized T only.

Every expert's weights are the same bytes wherever they are read from, and the computation does not depend
on where, so the output does not depend on the cache's size, policy or contents.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from common.experts.cache_tables import DECODE_GROUPS, DEFAULT_POLICY, CacheTables
from common.experts.formats import ExpertFormat, get_format
from common.experts.provider import ExpertProvider, add_shared
from common.experts.resident import batched_expert_mlp, grouped_expert_mlp
from common.experts.store import HostExpertStore
from common.kernels.config import KERNELS, KernelConfig, decode_config
from common.kv.lending import KvLending
from common.model.hf_config import read_json
from common.model.moe import install_provider

_FILLS, _BYPASSES, _ARENA, _LOADS = range(4)  # rows of the device counters of experts moved
TRAFFIC_ROWS = _LOADS + 1


@dataclass
class TrafficCounters:
    """Host → device traffic per MoE layer, as host ints (read from device counters between steps)."""

    cache_bytes: list[int]
    """Misses copied into a cache slot."""
    arena_bytes: list[int]
    """Experts copied into the prefill arena (whole layers streamed ahead too, used or not)."""
    arena_loads: list[int]
    """Arena copy launches that moved at least one expert."""
    bypass_bytes: list[int]
    """Bypassed misses copied into a staging row (for one step)."""
    prefetch_bytes: list[int]
    """Experts copied into a cache slot ahead of their layer's step (`OffloadedExperts.lookahead`; the
    tables' `prefetches` counter)."""


def copy_experts(
    parts: dict[str, torch.Tensor],
    src_ids: torch.Tensor,
    dst_rows: torch.Tensor,
    valid: torch.Tensor,
    pool: dict[str, torch.Tensor],
    spare: int,
    kernel: bool = False,
    merged: bool = False,
    background: bool = False,
) -> None:
    """pool[c][dst_rows[p]] ← parts[c][src_ids[p]] for every component c and every p with valid[p].

    parts: one layer's host blocks [E, ...]; src_ids, dst_rows [P] int64 and valid [P] bool on the pool's
    device. The shape is fixed and no count reaches the host. With `kernel` (CUDA, a mapped store) a Triton
    kernel reads the host rows directly and skips invalid pairs; otherwise torch ops copy every pair with the
    invalid ones redirected (host row 0 into the pool's `spare` row, whose contents do not matter). An
    unmapped store on CUDA has to bring the ids to the host: that fallback synchronises. With `merged` too,
    one launch copies every component (when their rows are whole words); with `background` too, in a few
    programs that leave the SMs to the compute running beside them (`expert_copy.BACKGROUND_PROGRAMS`).
    """
    if kernel:
        from common.kernels.expert_copy import BACKGROUND_PROGRAMS, copy_parts, copy_rows  # Triton: CUDA

        pairs = [(b, pool[n]) for n, b in parts.items()]
        programs = BACKGROUND_PROGRAMS if background else None
        if merged and copy_parts(pairs, src_ids, dst_rows, valid, programs):
            return
        for name, block in parts.items():
            copy_rows(block, pool[name], src_ids, dst_rows, valid)
        return
    src = torch.where(valid, src_ids, 0)  # [P]
    dst = torch.where(valid, dst_rows, spare)  # [P]
    for name, block in parts.items():
        rows = _bytes(block).index_select(0, src.to(block.device))  # [P, row bytes]
        _bytes(pool[name]).index_copy_(0, dst, rows.to(dst.device, non_blocking=True))


def _bytes(rows: torch.Tensor) -> torch.Tensor:
    """[R, ...] contiguous → [R, row bytes] uint8 view (copies treat every format's components as bytes)."""
    return rows.reshape(rows.shape[0], -1).view(torch.uint8)


Copies = tuple[torch.cuda.Event, ...] | None
"""A launch's events, one per stage of components (in order, on one stream: waiting for one waits for all
before it); None where copies run inline."""


class CopyStream:
    """Where expert copies run: a side stream for a mapped store on CUDA (fork and join through events, which
    a CUDA graph capture keeps), inline otherwise."""

    def __init__(
        self, store: HostExpertStore, pool: dict[str, torch.Tensor], spare: int, device: torch.device
    ) -> None:
        self.store, self.pool, self.spare = store, pool, spare
        self.side = torch.cuda.Stream(device) if device.type == "cuda" and store.mapped else None
        self.merged = False
        """One launch for all of an expert's components (opt-in: `common.kernels.use_fused_kernels`)."""

    def launch(
        self,
        layer: int,
        src_ids: torch.Tensor,
        dst_rows: torch.Tensor,
        valid: torch.Tensor,
        stages: tuple[tuple[str, ...], ...] | None = None,
        background: bool = False,
    ) -> Copies:
        """Start copying layer `layer`'s pairs after the main stream's work so far; the events to `join`.
        `stages`: the components in groups copied one after the other, each with its event (so a reader of
        the first group need not wait for the rest); default one group of every component. `background`:
        compute runs beside these copies (a lookahead's): a merged launch holds few SMs."""
        parts = self.store.parts[layer]
        if self.side is None:
            copy_experts(parts, src_ids, dst_rows, valid, self.pool, self.spare)
            return None
        self.side.wait_stream(torch.cuda.current_stream(self.side.device))  # fork: after the resolution
        events = []
        with torch.cuda.stream(self.side):
            for names in stages or (tuple(parts),):
                group = {name: parts[name] for name in names}
                copy_experts(
                    group, src_ids, dst_rows, valid, self.pool, self.spare, kernel=True, merged=self.merged,
                    background=background,
                )  # fmt: skip
                events.append(torch.cuda.Event())
                events[-1].record(self.side)
        for t in (src_ids, dst_rows, valid):  # made on the main stream, read on the side stream
            t.record_stream(self.side)
        return tuple(events)

    def launch_layer(self, layer: int, base: int) -> Copies:
        """Copy every expert of layer `layer` into pool rows [base, base + E), one DMA per component (the
        copy engines: the SMs stay with the compute, where a kernel reading host memory would hold them for
        the whole copy), after the main stream's work so far."""
        parts = self.store.parts[layer]
        if self.side is None:
            for name, block in parts.items():
                self.pool[name][base : base + block.shape[0]].copy_(block)
            return None
        self.side.wait_stream(torch.cuda.current_stream(self.side.device))  # fork: the buffer's last reader
        with torch.cuda.stream(self.side):
            for name, block in parts.items():
                self.pool[name][base : base + block.shape[0]].copy_(block, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.side)
        return (done,)

    def fence(self) -> Copies:
        """Events that stand for every copy queued so far (a lookahead's), launching none: what a step that
        copies its own misses waits for before reading its hits."""
        if self.side is None:
            return None
        self.side.wait_stream(torch.cuda.current_stream(self.side.device))  # fork: joins a capture too
        done = torch.cuda.Event()
        done.record(self.side)
        return (done, done)

    def join(self, done: Copies, stage: int = -1) -> None:
        """Make the main stream wait for a launch's copies up to `stage` (default all), right before their
        rows are read."""
        if done is not None:
            torch.cuda.current_stream(done[stage].device).wait_event(done[stage])


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


@dataclass
class Prepared:
    """`OffloadedExperts.prepare`'s handle: where each expert's weights are, and the copies to wait for."""

    rows: torch.Tensor
    """[E] pool row of each expert of the layer (meaningful for the requested ones)."""
    done: Copies
    cached: torch.Tensor | None = None
    """Prefill: [E] bool, the expert's row is a slot of the cache (else of this provider's arena); None:
    every row is the arena's."""


class OffloadedExperts(ExpertProvider):
    """The expert provider of a model whose routed experts live in a HostExpertStore."""

    kernels: KernelConfig = KERNELS
    """The kernel forms and launch options (set where the worker builds the model: `configure_kernels`)."""

    def __init__(
        self,
        store: HostExpertStore,
        tables: CacheTables,
        fmt: ExpertFormat,
        act: Callable[[torch.Tensor], torch.Tensor],
        moe_layers: list[int],
        device: torch.device | str,
        dtype: torch.dtype,
        shared_cache: tuple[dict[str, torch.Tensor], torch.Tensor] | None = None,
        arena_buffers: int = 2,
        lend_arena: bool = False,
        kv_lending: KvLending | None = None,
        arena_row: int | None = None,
    ) -> None:
        """`shared_cache` (the prefill worker's): another provider's (pool, slot_of) — decode's cache, mapped,
        read in place while its owner keeps it frozen; this provider then only runs prefill passes.
        `lend_arena`: the arena's second buffer is the tables' bank of E lendable slots (`CacheTables`
        built with `lendable=E`): the cache holds it during decode passes and gives it back before a
        prefill pass (see `begin_pass`). `kv_lending`: the tables' bank rows are the KV pool's idle pages
        (common/kv/lending.py; `KvLending.bind` starts lending once the state pool holds its tensors).
        `arena_row` (with `shared_cache`): this provider allocates no pool; its spare row and two arena
        buffers are `prefill_arena_rows` rows of the shared pool from that row on (decode's bank, which
        decode lends to its cache only while no prefill holds a freeze)."""
        self.store, self.tables, self.fmt, self.act = store, tables, fmt, act
        self.shared_cache = shared_cache
        self.device, self.dtype = torch.device(device), dtype
        self.index = {layer: i for i, layer in enumerate(moe_layers)}
        # slots, spare, arena buffer 0 (= decode's staging rows), buffer 1 (prefill overlap: a serving decode
        # worker, whose prompts another process prefills, keeps one buffer and gives the other to the cache;
        # lent to the cache between prefills, buffer 1 is the tables' bank, the last E slots)
        e = store.num_experts
        self.lend_arena = lend_arena
        if lend_arena and (arena_buffers != 2 or tables.bank.numel() != e or shared_cache is not None):
            raise ValueError(f"lending the arena needs two arena buffers and a bank of {e} slots")
        if kv_lending is not None and (lend_arena or shared_cache is not None):
            raise ValueError("KV lending does not combine with lending the arena or a shared cache")
        if arena_row is not None:
            rows = next(iter(shared_cache[0].values())).shape[0] if shared_cache is not None else 0
            need = prefill_arena_rows(e)
            if arena_row < 0 or arena_row + need > rows:
                raise ValueError(f"an arena of {need} rows from row {arena_row} overruns a pool of {rows}")
            self.pool, spare = shared_cache[0], arena_row
            bases = [arena_row + 1, arena_row + 1 + e]
        else:
            self.pool, spare = self._own_pool(tables, arena_buffers, kv_lending), tables.num_slots
            second = int(tables.bank[0]) if lend_arena else tables.staging_base + e
            bases = [tables.staging_base, second][:arena_buffers]
        self.copies = CopyStream(store, self.pool, spare, self.device)
        self.arena = PrefillArena(bases, e, self.device)
        self._moved = torch.zeros(TRAFFIC_ROWS, len(moe_layers), dtype=torch.int64, device=self.device)
        self._ahead = torch.cuda.Stream(self.device) if self.copies.side is not None else None
        """Where a lookahead's prediction and table update run (beside the main stream's work)."""
        self._ahead_done: torch.cuda.Event | None = None
        """The last lookahead's table update, which the next resolution waits for."""
        self._guesses_seen = torch.zeros(2, len(moe_layers), dtype=torch.int64, device=self.device)
        """The guess counters at the last `_gate_guesses`."""
        self._fill_pinned()
        self.prefill = False
        self.observing = False
        """This pass is a prompt's: its routing is counted in the cache statistics."""
        self.all_resident = False
        """Every expert holds a slot for good (`load_all`): passes read the slots, nothing is resolved or
        copied."""
        # int4 decode on CUDA: Triton kernels read the chosen rows' codes in place (kernels/moe_int4.py)
        self.int4_kernels = fmt.name == "int4" and act is F.silu and shared_cache is None
        self.fused_int4 = self.int4_kernels and self.device.type == "cuda"
        self.fused_int4_prefill = False
        """Prefill passes through the grouped int4 kernels (moe_int4_grouped.py); opt-in until measured."""
        self.fused_resolve = False
        """Resolve decode steps with one Triton program per layer (common/kernels/resolve.py: the same
        decisions as `CacheTables.resolve`) instead of ~130 torch ops. Opt-in until measured on the GPU."""
        self.combine_shared = True
        """With `fused_int4`: decode's shared expert added in the kernel that sums the choices (else by torch
        after it); a switch for bench.decode_offload --ablate."""
        self.dense_kernels = fmt.name in ("bf16", "fp8") and act is F.silu and shared_cache is None
        self.fused_dense = False
        """With `dense_kernels`: decode passes through the bf16 / fp8 decode kernels (moe_dense.py: each
        pair's weights read in place instead of gathered); opt-in until measured on the GPU."""
        names = tuple(store.components)
        self._split = tuple(tuple(n for n in names if n.startswith(p)) for p in ("gate_up", "down"))
        """The components in the two copy stages of a decode kernel that reads gate_up before down: its
        gate_up kernel starts as soon as those rows are in, while the down rows are still being copied."""
        self.step = torch.zeros((), dtype=torch.int64, device=self.device)  # on the device: recorded steps
        self.decode_passes = 0
        self.groups = 1
        """The groups of the pass being issued (`grouped`)."""
        self._turns: dict[int, torch.cuda.Event] = {}
        """In a grouped pass on CUDA: MoE layer → the last group's `turn` at it, which the next waits for."""

    def _own_pool(
        self, tables: CacheTables, arena_buffers: int, kv_lending: KvLending | None
    ) -> dict[str, torch.Tensor]:
        """The pool rows of `tables` (slots, spare, staging) and the arena buffers past them."""
        rows = tables.num_rows + (arena_buffers - 1 - int(self.lend_arena)) * self.store.num_experts
        components = self.store.components
        if kv_lending is not None:
            bank = tables.bank.numel()
            return kv_lending.expert_pool(components, rows, tables.num_slots - bank, bank)
        return {
            name: torch.empty((rows, *shape), dtype=dtype, device=self.device)
            for name, (shape, dtype) in components.items()
        }

    rebalance_every = 256
    """Decode passes between two per-layer capacity adjustments (host-side, between steps); lookahead's
    guesses are gated at the same cadence (`_gate_guesses`), and once before, after `first_gate`."""

    first_gate = 32
    """Decode passes after which lookahead's guesses are first gated: a layer starts copying its guesses in,
    and one that guesses at chance stops after this many passes rather than `rebalance_every` (on
    synthetic-zipf a copied guess costs ~58 % of the step while it runs)."""

    guess_precision = 0.5
    """A layer's lookahead copies its guesses in while at least this share of them was then requested over
    the decode passes since the last gate (measured whether it copies or not). Where lookahead paid, 98 %
    and 85 % were (+22 % and +12 % tok/s, bench/results/decode-1-routing-model-lookahead-*.json); where it
    cost 58 %, 1.8 % (synthetic-zipf: decode-1-lookahead-10.json)."""

    def _fill_pinned(self) -> None:
        """Load time: copy each layer's pinned experts into their slots."""
        for layer, slots in enumerate(self.tables.layer_slots):
            pinned = slots[self.tables.pinned[slots]]
            if pinned.numel():
                ok = torch.ones_like(pinned, dtype=torch.bool)
                self.copies.join(self.copies.launch(layer, self.tables.owner[pinned], pinned, ok))

    def load_all(self, release_host: bool = True) -> None:
        """All-experts-fit mode: give every expert of every layer a pinned slot and copy it there now; from
        then on passes read the slots directly (no resolution, no statistics, no copies; the arena is never
        used), and with `release_host` the host store's memory goes back to the OS. Needs a slot per expert
        (capacity `all`)."""
        e = self.store.num_experts
        if min(self.tables.capacities) < e:
            raise ValueError(f"load_all needs {e} slots per layer, the cache has {self.tables.capacities}")
        for layer in range(self.tables.num_layers):
            self.tables.pin(layer, range(e))
        self._fill_pinned()
        self.all_resident = True
        if release_host:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the copies read the host store until they finish
            self.store.release()

    def begin_pass(self, is_decode: bool, prompt: bool = False) -> None:
        """Called by the runner before each forward: decode passes use the cache, others the arena; a prompt
        pass's routing is counted in the cache statistics (`CacheTables.observe`); every `rebalance_every`
        decode passes, slots move to the layers where they are worth most (see `CacheTables.rebalance`)."""
        self._join_lookahead()  # one a pass that failed midway left (else the next prepare joins it)
        self.prefill = not is_decode or self.shared_cache is not None
        self.observing = prompt and not is_decode
        if self.lend_arena and is_decode:  # the arena's second buffer: the cache's between prefills
            self.tables.lend()
        elif self.lend_arena:
            self.tables.reclaim()
        self.arena.loaded.clear()
        self.step.add_(1)
        if is_decode:
            self.decode_passes += 1
            if self.decode_passes % self.rebalance_every == 0:
                per_layer = self.tables.num_slots // self.tables.num_layers
                self.tables.rebalance(slots_to_move=max(1, per_layer // 16))
                self._gate_guesses()
            elif self.decode_passes == self.first_gate:
                self._gate_guesses()

    @property
    def max_groups(self) -> int:
        """A decode pass through the cache may be split (an all-resident cache has nothing to overlap)."""
        return 1 if self.all_resident or self.shared_cache is not None else DECODE_GROUPS

    @contextmanager
    def grouped(self, groups: int) -> Iterator[None]:
        """A decode pass of `groups` groups of lanes (common/model/groups.py). Each group resolves each layer
        as a step of its own (`CacheTables.resolve`'s `group`), in turn (`turn`), so that one group's
        copies run while another computes: they run in the background form (a few programs: one per item
        would hold every SM, and the other group's kernels would queue behind them; a profile of decode-8
        showed 2-µs kernels taking 40-70). That form needs merged copies (`CopyStream.merged`, on with the
        fused kernels): per-component launches keep one program per item. Lookahead's guesses are not
        made in a grouped pass (they would be one group's, and its stream and update are one at a time)."""
        with super().grouped(groups):
            self.groups, self.group = groups, 0
            self._turns.clear()
            try:
                yield
            finally:
                self.groups, self.group = 1, 0
                self._turns.clear()

    def regroup(self, groups: int) -> None:
        if self.max_groups > 1:
            self.tables.regroup(groups)

    @contextmanager
    def turn(self, layer: int) -> Iterator[None]:
        """Group g's routing replay and resolution of a layer after group g−1's: both update the layer's
        tables (and a replay's cursor) in place."""
        if self.groups == 1 or self.device.type != "cuda":  # one group, or groups run in order (CPU)
            yield
            return
        stream = torch.cuda.current_stream(self.device)
        before = self._turns.pop(layer, None)
        if before is not None:
            stream.wait_event(before)
        yield
        self._turns[layer] = torch.cuda.Event()
        self._turns[layer].record(stream)

    def _gate_guesses(self) -> None:
        """Between steps, as device ops (no sync): each layer that guessed since the last call copies its
        guesses in from now on if at least `guess_precision` of them were requested (else it only keeps
        measuring them)."""
        counters, guessing = self.tables.counters, self.tables.guessing
        seen = torch.stack([counters["guesses"], counters["guesses_used"]])  # [2, L]
        made, used = (seen - self._guesses_seen).unbind()
        guessing.copy_(torch.where(made > 0, used >= self.guess_precision * made, guessing))
        self._guesses_seen.copy_(seen)

    @contextmanager
    def untracked(self) -> Iterator[None]:
        """Passes that leave no trace (a warm-up): the cache frozen, so nothing is inserted or evicted (a miss
        is computed from a staging row), and its statistics, counters, traffic and step put back after. Lent
        arena slots are taken back first (a prefill pass needs them, and a frozen cache cannot give them)."""
        t = self.tables
        if self.lend_arena:
            t.reclaim()
        names = ("freq", "absent", "previous", "observed", "reuse", "counts", "last_use")
        names += ("fetched", "predicted")
        saved = {n: getattr(t, n).clone() for n in names}
        moved, step, passes, frozen = self._moved.clone(), self.step.clone(), self.decode_passes, t.frozen
        groups = t.groups  # the previous steps are put back as they were: their grouping too
        t.frozen = True
        try:
            yield
        finally:
            for n, value in saved.items():
                getattr(t, n).copy_(value)
            self._moved.copy_(moved)
            self.step.copy_(step)
            self.decode_passes, t.frozen, t.groups = passes, frozen, groups

    def traffic(self) -> TrafficCounters:
        """Bytes moved host → device so far, per MoE layer. Reads device counters (a sync): between steps."""
        fills, bypasses, arena, loads = self._moved.tolist()
        prefetches = self.tables.counters["prefetches"].tolist()
        b = self.store.expert_bytes
        return TrafficCounters(
            cache_bytes=[n * b for n in fills],
            arena_bytes=[n * b for n in arena],
            arena_loads=loads,
            bypass_bytes=[n * b for n in bypasses],
            prefetch_bytes=[n * b for n in prefetches],
        )

    def forward(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        return self.compute(layer, self.prepare(layer, topk_ids), x, topk_ids, topk_weights)

    def prepare(self, layer: int, topk_ids: torch.Tensor) -> Prepared:
        """Resolve `layer`'s experts and launch their copies (on the side stream where there is one)."""
        i = self.index[layer]
        self._join_lookahead()
        if self.all_resident:  # every expert in its slot: nothing to resolve or copy
            return Prepared(rows=self.tables.slot_of[i, : self.store.num_experts], done=None)
        if self.groups > 1 and topk_ids.numel() > self.store.num_experts // self.groups:
            raise ValueError(
                f"a group of {topk_ids.shape[0]} lanes has more choices than its {self.store.num_experts} "
                f"// {self.groups} staging rows"
            )
        if self.fused_resolve and not self.prefill:
            from common.kernels.resolve import resolve_step  # Triton

            row, newcomer, target, valid = resolve_step(
                self.tables, i, topk_ids, self.step, self._moved, group=self.group, groups=self.groups,
                kernels=self.kernels,
            )  # fmt: skip
            return self._copy_misses(i, row, newcomer, target, valid, topk_ids.shape[0])
        requested = self._chosen(topk_ids)
        if self.prefill:
            if self.observing:  # decode's rates start from it (a prefill worker's: PrefillDone.routing)
                self.tables.observe(i, topk_ids)
            return self._prepare_arena(i, requested, topk_ids.numel())
        return self._prepare_cache(i, requested, topk_ids.numel(), topk_ids.shape[0])

    def lookahead(self, layer: int, x: torch.Tensor, predict: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Decode passes: copy the experts `predict(x)` ([T, n] ids) guesses for MoE layer `layer` into slots
        now, while the layers before it compute (`CacheTables.prefetch`: the victims its misses would take,
        at most T·n of them). The guess and the table update run on a stream of their own, the copies on
        the copy stream behind the misses already queued; the layer's `prepare` waits for the update, its
        `compute` for the copies (queued before its own). Elsewhere it runs inline; prefill passes and an
        all-resident cache skip it. A layer whose guesses are seldom requested only records them
        (`guess_precision`)."""
        if self.prefill or self.all_resident or self.shared_cache is not None or self.groups > 1:
            return
        i = self.index[layer]
        self._join_lookahead()  # one update at a time
        if self._ahead is None:
            self._prefetch(i, predict(x))
            return
        self._ahead.wait_stream(torch.cuda.current_stream(self.device))  # fork: after the hidden state
        x.record_stream(self._ahead)  # made on the main stream, read on this one
        with torch.cuda.stream(self._ahead):
            self._prefetch(i, predict(x))
            self._ahead_done = torch.cuda.Event()
            self._ahead_done.record(self._ahead)

    def _prefetch(self, i: int, ids: torch.Tensor) -> None:
        """Table update and copy launch of a lookahead for MoE layer index i, on the current stream."""
        if self.fused_resolve:
            from common.kernels.resolve import prefetch_step  # Triton

            newcomer, target, valid = prefetch_step(
                self.tables, i, ids, self.step, ids.numel(), kernels=self.kernels
            )
        else:
            newcomer, target, valid = self.tables.prefetch(i, self._chosen(ids), self.step, ids.numel())
        self.copies.launch(i, newcomer, target, valid, background=True)

    def _chosen(self, ids: torch.Tensor) -> torch.Tensor:
        """[E] bool: the layer's experts among `ids` (t[i] = True would synchronise: a fill instead)."""
        chosen = torch.zeros(self.store.num_experts, dtype=torch.bool, device=ids.device)
        return chosen.index_fill_(0, ids.reshape(-1), True)

    def _join_lookahead(self) -> None:
        """Make the current stream wait for the last lookahead's table update."""
        if self._ahead_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._ahead_done)
            self._ahead_done = None

    def compute(
        self,
        layer: int,
        prepared: object,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        shared: torch.Tensor | None = None,
        shared_gate: torch.Tensor | None = None,
        settled: bool = False,
    ) -> torch.Tensor:
        assert isinstance(prepared, Prepared)
        if self.fused_int4 and not self.prefill:  # the int4 decode kernels, which add the shared expert
            return self._int4_decode(prepared, x, topk_ids, topk_weights, shared, shared_gate, settled)
        return add_shared(self._routed(prepared, x, topk_ids, topk_weights), shared, shared_gate)

    def _routed(
        self, prepared: Prepared, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """The routed experts' weighted sum, on every path but the int4 decode kernel's."""
        if self.prefill and self.fused_int4_prefill:
            from common.kernels.moe_int4_grouped import moe_int4_grouped  # Triton

            self.copies.join(prepared.done)
            return moe_int4_grouped(x, topk_ids, topk_weights, prepared.rows, self.pool)
        if self.prefill:
            row = prepared.rows.tolist()  # prefill is not captured; read before waiting for the copies
            mapped = self.shared_cache is not None and prepared.cached is not None  # rows in decode's pool
            cached = prepared.cached.tolist() if mapped else None
            self.copies.join(prepared.done)

            def weights_of(e: int) -> tuple[torch.Tensor, torch.Tensor]:
                pool = self.shared_cache[0] if cached is not None and cached[e] else self.pool
                return self.fmt.unpack({n: t[row[e]] for n, t in pool.items()}, self.dtype)

            return grouped_expert_mlp(x, weights_of, topk_ids, topk_weights, self.act)
        if self._kernel_decode:  # bf16 / fp8 (int4: `_int4_decode`)
            from common.kernels.moe_dense import moe_dense_decode  # Triton

            self.copies.join(prepared.done, stage=0)  # gate_up's rows: down's may still be on their way
            return moe_dense_decode(
                x, prepared.rows[topk_ids], topk_weights, self.pool,
                before_down=lambda: self.copies.join(prepared.done),
            )  # fmt: skip
        self.copies.join(prepared.done)
        t, k = topk_ids.shape
        rows = prepared.rows[topk_ids].reshape(-1)  # [T*k]
        parts = {n: p.index_select(0, rows) for n, p in self.pool.items()}  # [T*k, ...] each
        gate_up, down = self.fmt.unpack_many(parts, self.dtype)  # [T*k, 2I, H], [T*k, H, I]
        gate_up, down = gate_up.view(t, k, *gate_up.shape[1:]), down.view(t, k, *down.shape[1:])
        return batched_expert_mlp(x, gate_up, down, topk_ids, topk_weights, self.act)

    def _int4_decode(
        self,
        prepared: Prepared,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        shared: torch.Tensor | None,
        shared_gate: torch.Tensor | None,
        settled: bool,
    ) -> torch.Tensor:
        """A decode pass through the int4 kernels: the rows read in place once their copies are in (gate_up's
        before down's); the shared expert added in the kernel that sums the choices. Launch shapes from
        KernelConfig.int4_resident when every expert is resident (no copies beside the kernels), else
        .int4_decode: the two cases measured apart."""
        from common.kernels import moe_int4  # Triton: CUDA

        fold = self.combine_shared
        kernels = self.kernels
        configs = kernels.int4_resident if self.all_resident else kernels.int4_decode
        config = decode_config(x.shape[0], configs)
        out = moe_int4.moe_int4_decode(
            x, topk_ids, topk_weights, self.pool, config=config, kernels=kernels, row_of=prepared.rows,
            before_down=lambda: self.copies.join(prepared.done),  # down's rows come after gate_up's
            before_gate_up=lambda: self.copies.join(prepared.done, stage=0),
            shared=shared if fold else None, shared_gate=shared_gate if fold else None,
            settled=settled,
        )  # fmt: skip
        return out if fold else add_shared(out, shared, shared_gate)

    @property
    def _kernel_decode(self) -> bool:
        """Decode passes run a Triton kernel that reads the chosen rows in place, gate_up before down (int4 on
        CUDA; bf16 / fp8 with `fused_dense`): their copies come in two stages (`_stages`)."""
        return self.fused_int4 or (self.fused_dense and self.dense_kernels)

    @property
    def _stages(self) -> tuple[tuple[str, ...], ...] | None:
        """A decode step's copy stages: gate_up's components, then down's, for a kernel decode; else one."""
        return self._split if self._kernel_decode else None

    def _prepare_cache(self, i: int, requested: torch.Tensor, choices: int, tokens: int) -> Prepared:
        e = self.store.num_experts
        res = self.tables.resolve(i, requested, self.step, min(choices, e), self.group, self.groups)
        self._moved[_FILLS, i].add_(res.filled.sum())
        self._moved[_BYPASSES, i].add_(res.bypass.sum())
        return self._copy_misses(i, res.row, res.newcomer, res.target, res.valid, tokens)

    def _copy_misses(
        self, i: int, row: torch.Tensor, newcomer: torch.Tensor, target: torch.Tensor, valid: torch.Tensor,
        tokens: int,
    ) -> Prepared:  # fmt: skip
        """A decode step's resolution → its handle: the misses' copies launched."""
        done = self.copies.launch(i, newcomer, target, valid, self._stages, self.groups > 1)
        return Prepared(rows=row, done=done)

    def _prepare_arena(self, i: int, requested: torch.Tensor, choices: int) -> Prepared:
        """Big chunks (T·k ≥ prefetch_factor · E: nearly every expert is used): whole layers into alternate
        buffers by DMA, the next layer's launched now so that it streams while this one computes; the
        cache is not read (its share of the experts would save bytes but cost a per-expert copy list, and a
        kernel copying them holds SMs the compute needs). Smaller chunks: cached experts in place (a
        read-only peek: no statistics), the others copied into the layer's buffer after routing."""
        if self.arena.should_prefetch(choices):
            done = self._arena_layer(i)  # launched by the layer before (or now, for the first)
            if i + 1 < len(self.index):
                self._arena_layer(i + 1)
            return Prepared(rows=self.arena.rows(i), done=done)
        table = self.shared_cache[1] if self.shared_cache is not None else self.tables.slot_of
        slot_of = table[i, : self.store.num_experts]  # [E]
        cached = slot_of >= 0
        need = requested & ~cached
        done = self.copies.launch(i, self.arena.ids, self.arena.rows(i), need)
        self._moved[_ARENA, i].add_(need.sum())
        self._moved[_LOADS, i].add_(need.any())
        return Prepared(rows=torch.where(cached, slot_of, self.arena.rows(i)), done=done, cached=cached)

    def _arena_layer(self, i: int) -> Copies:
        """The copy of MoE layer i's experts into its buffer: the one under way, or a new one."""
        loaded = self.arena.loaded
        if i not in loaded:
            loaded.pop(i - self.arena.buffers, None)  # the layer whose buffer this overwrites
            loaded[i] = self.copies.launch_layer(i, self.arena.bases[i % self.arena.buffers])
            self._moved[_ARENA, i].add_(self.store.num_experts)
            self._moved[_LOADS, i].add_(1)
        return loaded[i]


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
    host_allocate: Callable[[int], torch.Tensor] | None = None,
    arena_buffers: int = 2,
    lend_arena: bool = False,
    kv_lending: KvLending | None = None,
    prefill_bank: bool = False,
) -> OffloadedExperts:
    """Serve `model`'s routed experts from a host store through a VRAM cache of `capacity` (see
    parse_capacity) under `policy`; `pinned` maps MoE layer index → hot experts. Without `store` the model's
    resident experts are packed into a new one in format `fmt` (and freed; `host_allocate(nbytes)` makes its
    memory, e.g. shared memory a prefill worker maps); with it (an artifact's), used. `lend_arena`: the
    arena's second buffer serves as E more cache slots between prefills (see OffloadedExperts);
    `kv_lending`: as many more as the KV pool's pages hold, while no sequence needs them; `prefill_bank`:
    1 + 2E more, a prefill worker's arena (`arena_row`), lent by the decode worker between prefills."""
    resident = model.experts
    cfg = model.config
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    layers = sorted(cfg.moe_layers)
    form = get_format(fmt)
    if store is None:
        components = form.components(cfg.hidden_size, cfg.moe_intermediate_size)
        store = HostExpertStore(len(layers), cfg.num_experts, components, allocate=host_allocate)
        for i, layer in enumerate(layers):
            w = resident.weights.pop(layer)  # free each resident layer as it is packed
            store.fill(i, [form.pack(w.gate_up[e].cpu(), w.down[e].cpu()) for e in range(cfg.num_experts)])
    elif store.num_layers != len(layers) or store.num_experts != cfg.num_experts:
        raise ValueError(
            f"expert store of {store.num_layers}×{store.num_experts}, model has "
            f"{len(layers)}×{cfg.num_experts}"
        )
    capacities = parse_capacity(capacity, len(layers), cfg.num_experts)
    lendable = cfg.num_experts if lend_arena else prefill_arena_rows(cfg.num_experts) if prefill_bank else 0
    if kv_lending is not None:
        lendable = kv_lending.bank_size(store.components, sum(capacities))
    tables = CacheTables(
        len(layers), cfg.num_experts, capacities, policy, device, pinned=pinned, lendable=lendable
    )
    provider = OffloadedExperts(
        store, tables, form, resident.act, layers, device, dtype, arena_buffers=arena_buffers,
        lend_arena=lend_arena, kv_lending=kv_lending,
    )  # fmt: skip
    install_provider(model, provider)
    return provider


def load_hot_set(path: str | Path) -> dict[int, list[int]]:
    """A calibration hot set: JSON `{"MoE layer index": [expert ids]}` (say, a trace's most used experts)."""
    data = read_json(Path(path))
    try:
        return {int(layer): [int(e) for e in experts] for layer, experts in data.items()}
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: expected {{layer: [expert ids]}}: {exc}") from exc
