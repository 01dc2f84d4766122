"""OffloadedExperts: routed experts in host memory, served by the VRAM cache (decode) or an arena (prefill).

The pool: one device tensor per weight component, one expert a row, S + 1 + 2·E rows: the cache's slots
[0, S), a spare row S (it absorbs invalid copies), then two arena buffers of E rows, buffer b at rows
S+1+b·E+e; the first doubles as decode's staging rows (a bypassed miss is copied there for one step).

Paths: each kind of pass has its strategy (`ExpertPath`), chosen when the provider is built (or by
`load_all`): decode through the cache (`CacheDecode`), prefill through the arena (`ArenaPrefill`), or every
expert resident (`ResidentPath`). `begin_pass` picks the one a pass runs. Every expert's weights are the
same bytes wherever they are read from, so the output does not depend on the cache's size, policy or
contents.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from common.experts.cache_tables import DEFAULT_POLICY, CacheTables
from common.experts.copies import CopyStream
from common.experts.decode_path import CacheDecode, DecodeKernels, Lookahead
from common.experts.formats import ExpertFormat, get_format
from common.experts.kv_lending import KvLending
from common.experts.paths import ExpertPath, KernelSwitches, Prepared, ResidentPath
from common.experts.prefill_path import (
    ArenaPrefill,
    GroupedKernels,
    PrefillArena,
    SharedCache,
    prefill_arena_rows,
)
from common.experts.store import HostExpertStore
from common.experts.traffic import TrafficCounters, traffic_counts
from common.kernels.config import KernelConfig
from common.model.hf_config import read_json
from common.model.moe import install_provider
from common.model.provider import ExpertProvider
from common.model.resident import ResidentExperts
from common.progress import progress

if TYPE_CHECKING:
    from common.config import ModelConfig


class _Switch:
    """An `OffloadedExperts` attribute that reads and writes its `KernelSwitches` field of the same name."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: OffloadedExperts, objtype: type | None = None) -> bool:
        return bool(getattr(obj.switches, self.name))

    def __set__(self, obj: OffloadedExperts, value: bool) -> None:
        setattr(obj.switches, self.name, value)


class OffloadedExperts(ExpertProvider):
    """The expert provider of a model whose routed experts live in a HostExpertStore."""

    int4_kernels, fused_int4, dense_kernels = _Switch(), _Switch(), _Switch()
    fused_int4_prefill, fused_dense_prefill, fused_resolve = _Switch(), _Switch(), _Switch()

    @property
    def kernels(self) -> KernelConfig:
        """The kernel forms and launch options (`KernelSwitches.kernels`; set where the worker builds the
        model: `configure_kernels`)."""
        return self.switches.kernels

    @kernels.setter
    def kernels(self, kernels: KernelConfig) -> None:
        self.switches.kernels = kernels

    decode_path: ExpertPath
    """What decode passes run on (a provider over a shared cache: `prefill_path`)."""
    prefill_path: ExpertPath
    """What prefill passes run on."""
    path: ExpertPath
    """The path of the pass being issued (`begin_pass`)."""

    rebalance_every = 256
    """Decode passes between two per-layer capacity adjustments (host-side, between steps); lookahead's
    guesses are gated at the same cadence (`Lookahead.gate`), and once before, after `first_gate`."""

    first_gate = 32
    """Decode passes after which lookahead's guesses are first gated: a layer starts copying its guesses in,
    and one that guesses at chance stops after this many passes rather than `rebalance_every` (a copied guess
    that is not used costs copy bandwidth the step's misses need)."""

    guess_precision = 0.5
    """A layer's lookahead copies its guesses in while at least this share of them was then requested over
    the decode passes since the last gate (measured whether it copies or not)."""

    def __init__(
        self,
        store: HostExpertStore,
        tables: CacheTables,
        fmt: ExpertFormat,
        act: Callable[[torch.Tensor], torch.Tensor],
        moe_layers: list[int],
        device: torch.device | str,
        dtype: torch.dtype,
        shared_cache: SharedCache | None = None,
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
        (common/experts/kv_lending.py; `KvLending.bind` starts lending once the state pool holds its tensors).
        `arena_row` (with `shared_cache`): this provider allocates no pool; its spare row and two arena
        buffers are `prefill_arena_rows` rows of the shared pool from that row on (decode's bank, which
        decode lends to its cache only while no prefill holds a freeze)."""
        self.store, self.tables, self.fmt, self.act = store, tables, fmt, act
        self.shared_cache = shared_cache
        self.device, self.dtype = torch.device(device), dtype
        self.index = {layer: i for i, layer in enumerate(moe_layers)}
        self.lend_arena = lend_arena
        self.pool, spare, bases = _pool_layout(
            store, tables, self.device, shared_cache, arena_buffers, lend_arena, kv_lending, arena_row
        )
        self.copies = CopyStream(store, self.pool, spare, self.device)
        self.arena = PrefillArena(bases, store.num_experts, self.device)
        self._moved = traffic_counts(len(moe_layers), self.device)
        """Experts moved host → device per MoE layer (`traffic`)."""
        self.ahead = Lookahead(tables, self.device, self.copies.side is not None)
        self._fill_pinned()
        self.switches = KernelSwitches.for_pool(fmt, act, shared_cache is None, self.device)
        self.step = torch.zeros((), dtype=torch.int64, device=self.device)  # on the device: recorded steps
        self.decode_passes = 0
        self.prefill = False
        """The pass being issued runs on `prefill_path` (else `decode_path`)."""
        self.all_resident = False
        """Every expert holds a slot for good (`load_all`): passes read the slots, nothing is resolved or
        copied."""
        self.groups = 1
        """The groups of the pass being issued (`grouped`)."""
        self._turns: dict[int, torch.cuda.Event] = {}
        """In a grouped pass on CUDA: MoE layer → the last group's `turn` at it, which the next waits for."""
        self.grouped_kernels = GroupedKernels(
            self.pool, self.copies, fmt, act, dtype, self.switches, shared_cache
        )
        self.prefill_path = ArenaPrefill(
            store, tables, self.copies, self.arena, self.grouped_kernels, self._moved, len(moe_layers)
        )
        self.decode_path = (
            self.prefill_path if shared_cache is not None else CacheDecode(
                store, tables, self.copies, self._decode_kernels(resident=False), self._moved, self.step,
                self.ahead,
            )
        )  # fmt: skip
        self.path = self.decode_path
        self.max_groups = self.decode_path.max_groups
        """A decode pass through the cache may be split (an all-resident cache has nothing to overlap)."""

    def _decode_kernels(self, resident: bool) -> DecodeKernels:
        return DecodeKernels(self.pool, self.copies, self.fmt, self.act, self.dtype, self.switches, resident)

    def _fill_pinned(self) -> None:
        """Load time: copy each layer's pinned experts into their slots."""
        for layer, slots in enumerate(self.tables.layer_slots):
            pinned = slots[self.tables.pinned[slots]]
            if pinned.numel():
                ok = torch.ones_like(pinned, dtype=torch.bool)
                self.copies.join(self.copies.launch(layer, self.tables.owner[pinned], pinned, ok))

    def load_all(self, release_host: bool = True) -> None:
        """All-experts-fit mode: give every expert of every layer a pinned slot and copy it there now; from
        then on passes read the slots directly (`ResidentPath`: no resolution, no statistics, no copies; the
        arena is never used), and with `release_host` the host store's memory goes back to the OS. Needs a
        slot per expert (capacity `all`)."""
        e = self.store.num_experts
        if min(self.tables.capacities) < e:
            raise ValueError(f"load_all needs {e} slots per layer, the cache has {self.tables.capacities}")
        for layer in range(self.tables.num_layers):
            self.tables.pin(layer, range(e))
        self._fill_pinned()
        self.all_resident = True
        self.decode_path = ResidentPath(self.tables, e, self._decode_kernels(resident=True))
        self.prefill_path = ResidentPath(self.tables, e, self.grouped_kernels)
        self.path = self.prefill_path if self.prefill else self.decode_path
        self.max_groups = self.decode_path.max_groups
        if release_host:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the copies read the host store until they finish
            self.store.release()

    def begin_pass(self, is_decode: bool, prompt: bool = False) -> None:
        """Called by the runner before each forward: decode passes use the cache, others the arena; a prompt
        pass's routing is counted in the cache statistics (`CacheTables.observe`); every `rebalance_every`
        decode passes, slots move to the layers where they are worth most (see `CacheTables.rebalance`)."""
        self.ahead.join()  # one a pass that failed midway left (else the next prepare joins it)
        self.prefill = not is_decode or self.shared_cache is not None
        self.path = self.prefill_path if self.prefill else self.decode_path
        self.path.begin(prompt=prompt and not is_decode)
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
                self.ahead.gate(self.guess_precision)
            elif self.decode_passes == self.first_gate:
                self.ahead.gate(self.guess_precision)

    @contextmanager
    def grouped(self, groups: int) -> Iterator[None]:
        """A decode pass of `groups` groups of lanes (common/model/groups.py). Each group resolves each layer
        as a step of its own (`CacheTables.resolve`'s `group`), in turn (`turn`), so that one group's
        copies run while another computes: they run in the background form (a few programs: one per item
        would hold every SM, and the other group's kernels would queue behind them). That form needs merged
        copies (`CopyStream.merged`, on with the fused kernels): per-component launches keep one program per
        item. Lookahead's guesses are not made in a grouped pass (they would be one group's, and its stream
        and update are one at a time)."""
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

    @contextmanager
    def untracked(self) -> Iterator[None]:
        """Passes that leave no trace (a warm-up): the cache frozen, so nothing is inserted or evicted (a miss
        is computed from a staging row), and its statistics, counters, traffic and step put back after. Lent
        arena slots are taken back first (a prefill pass needs them, and a frozen cache cannot give them)."""
        t = self.tables
        if self.lend_arena:
            t.reclaim()
        names: tuple[str, ...] = ("freq", "absent", "previous", "observed", "reuse", "counts", "last_use")
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
        return TrafficCounters.read(self._moved, self.tables.counters["prefetches"], self.store.expert_bytes)

    def forward(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        return self.compute(layer, self.prepare(layer, topk_ids), x, topk_ids, topk_weights)

    def prepare(self, layer: int, topk_ids: torch.Tensor) -> Prepared:
        """Resolve `layer`'s experts and launch their copies (on the side stream where there is one)."""
        i = self.index[layer]
        self.ahead.join()
        return self.path.prepare(i, topk_ids, self.group, self.groups)

    def lookahead(self, layer: int, x: torch.Tensor, predict: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Decode passes through the cache: copy the experts `predict(x)` ([T, n] ids) guesses for MoE layer
        `layer` into slots now, while the layers before it compute (`CacheDecode.lookahead`); the layer's
        `prepare` waits for the table update, its `compute` for the copies (queued before its own). Other
        paths skip it. A layer whose guesses are seldom requested only records them (`guess_precision`)."""
        self.path.lookahead(self.index[layer], x, predict, self.groups)

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
        return self.path.compute(prepared, x, topk_ids, topk_weights, shared, shared_gate, settled)


def _pool_layout(
    store: HostExpertStore,
    tables: CacheTables,
    device: torch.device,
    shared_cache: SharedCache | None,
    arena_buffers: int,
    lend_arena: bool,
    kv_lending: KvLending | None,
    arena_row: int | None,
) -> tuple[dict[str, torch.Tensor], int, list[int]]:
    """(pool, spare row, first row of each arena buffer) of an `OffloadedExperts` (its arguments' meaning):
    slots, spare, arena buffer 0 (= decode's staging rows), buffer 1 (a serving decode worker, whose prompts
    another process prefills, keeps one buffer and gives the other to the cache; lent to the cache between
    prefills, buffer 1 is the tables' bank, the last E slots)."""
    e = store.num_experts
    if lend_arena and (arena_buffers != 2 or tables.bank.numel() != e or shared_cache is not None):
        raise ValueError(f"lending the arena needs two arena buffers and a bank of {e} slots")
    if kv_lending is not None and (lend_arena or shared_cache is not None):
        raise ValueError("KV lending does not combine with lending the arena or a shared cache")
    if arena_row is not None:
        rows = next(iter(shared_cache[0].values())).shape[0] if shared_cache is not None else 0
        need = prefill_arena_rows(e)
        if shared_cache is None or arena_row < 0 or arena_row + need > rows:
            raise ValueError(f"an arena of {need} rows from row {arena_row} overruns a pool of {rows}")
        return shared_cache[0], arena_row, [arena_row + 1, arena_row + 1 + e]
    rows = tables.num_rows + (arena_buffers - 1 - int(lend_arena)) * e
    if kv_lending is not None:
        bank = tables.bank.numel()
        pool = kv_lending.expert_pool(store.components, rows, tables.num_slots - bank, bank)
    else:
        pool = {
            name: torch.empty((rows, *shape), dtype=dtype, device=device)
            for name, (shape, dtype) in store.components.items()
        }
    second = int(tables.bank[0]) if lend_arena else tables.staging_base + e
    return pool, tables.num_slots, [tables.staging_base, second][:arena_buffers]


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
    memory, e.g. shared memory a prefill worker maps; a checkpoint's published NVFP4 / MXFP4 experts go in
    as they are, in their format, whatever `fmt`); with it (an artifact's), used. `lend_arena`: the
    arena's second buffer serves as E more cache slots between prefills (see OffloadedExperts);
    `kv_lending`: as many more as the KV pool's pages hold, while no sequence needs them; `prefill_bank`:
    1 + 2E more, a prefill worker's arena (`arena_row`), lent by the decode worker between prefills."""
    resident = cast(ResidentExperts, model.experts)
    cfg = cast("ModelConfig", model.config)
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    layers = sorted(cfg.moe_layers)
    form = get_format(fmt if resident.published is None else resident.published[0])
    if store is None:
        components = form.components(cfg.hidden_size, cfg.moe_intermediate_size)
        store = HostExpertStore(len(layers), cfg.num_experts, components, allocate=host_allocate)
        for i, layer in enumerate(progress(layers, f"host store ({form.name})", unit="layer")):
            if resident.published is not None:  # the checkpoint's own bits, as published
                resident.weights.pop(layer, None)
                parts = resident.published[1].pop(layer)
                store.fill(i, [{n: t[e] for n, t in parts.items()} for e in range(cfg.num_experts)])
                continue
            w = resident.weights.pop(layer)  # free each resident layer as it is packed
            store.fill(i, [_packed_on_host(form, w.gate_up[e], w.down[e]) for e in range(cfg.num_experts)])
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


def _packed_on_host(form: ExpertFormat, gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
    """One expert packed where its weights are (a GPU runs a trellis encoder's search), kept on the host."""
    return {name: t.cpu() for name, t in form.pack(gate_up, down).items()}


def load_hot_set(path: str | Path) -> dict[int, list[int]]:
    """A calibration hot set: JSON `{"MoE layer index": [expert ids]}` (say, a trace's most used experts)."""
    data = read_json(Path(path))
    try:
        return {int(layer): [int(e) for e in experts] for layer, experts in data.items()}
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: expected {{layer: [expert ids]}}: {exc}") from exc
