"""Decode passes through the VRAM cache: each layer's experts resolved against the cache tables (device ops,
fixed shapes), the misses copied in by one fixed-shape launch, the chosen rows computed at once — no host
sync, no loop over experts (a CUDA graph records the step). Also the lookahead, which copies a layer's
guessed experts in while the layers before it compute."""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.experts.cache_tables import DECODE_GROUPS, CacheTables
from common.experts.copies import CopyStream
from common.experts.formats import ExpertFormat
from common.experts.paths import ExpertPath, KernelSwitches, Prepared, check_group, chosen
from common.experts.store import HostExpertStore
from common.experts.traffic import BYPASSES, FILLS
from common.kernels.config import decode_config
from common.model.provider import add_shared
from common.model.resident import batched_expert_mlp


class DecodeKernels:
    """A decode pass's routed experts from their pool rows: the int4 kernels (`fused_int4`), the dense
    kernels for the formats they read (`KernelConfig.moe_dense`), else torch gathering the T·k chosen
    experts dequantised at once (T·k·3·H·I values: decode-sized T only). `resident`: no copies run beside
    the kernels (int4's resident shapes)."""

    def __init__(
        self,
        pool: dict[str, torch.Tensor],
        copies: CopyStream,
        fmt: ExpertFormat,
        act: Callable[[torch.Tensor], torch.Tensor],
        dtype: torch.dtype,
        switches: KernelSwitches,
        resident: bool = False,
    ) -> None:
        self.pool, self.copies, self.fmt, self.act, self.dtype = pool, copies, fmt, act, dtype
        self.switches, self.resident = switches, resident
        names = tuple(copies.store.components)
        self.split = tuple(tuple(n for n in names if n.startswith(p)) for p in ("gate_up", "down"))
        """The components in the two copy stages of a kernel that reads gate_up before down: its gate_up
        kernel starts as soon as those rows are in, while the down rows are still being copied."""

    @property
    def in_place(self) -> bool:
        """A Triton kernel reads the chosen rows in place, gate_up before down (int4 on CUDA; the dense
        formats with `KernelConfig.moe_dense`): their copies come in two stages (`stages`)."""
        s = self.switches
        return s.fused_int4 or (s.kernels.moe_dense and s.dense_kernels)

    @property
    def stages(self) -> tuple[tuple[str, ...], ...] | None:
        """A step's copy stages: gate_up's components, then down's, for an in-place kernel; else one."""
        return self.split if self.in_place else None

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
        if self.switches.fused_int4:  # the int4 decode kernels, which add the shared expert
            return self._int4(prepared, x, topk_ids, topk_weights, shared, shared_gate, settled)
        return add_shared(self._routed(prepared, x, topk_ids, topk_weights), shared, shared_gate)

    def _routed(
        self, prepared: Prepared, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """The routed experts' weighted sum [T, H], but through the int4 kernels."""
        if self.in_place:  # the dense kernels' formats (int4: `_int4`)
            from common.kernels.moe_dense import moe_dense_decode  # Triton

            self.copies.join(prepared.done, stage=0)  # gate_up's rows: down's may still be on their way
            return moe_dense_decode(
                x, prepared.rows[topk_ids], topk_weights, self.pool,
                before_down=lambda: self.copies.join(prepared.done), param=self.fmt.kernel_param,
                mixing=self.fmt.kernel_mixing(),
            )  # fmt: skip
        self.copies.join(prepared.done)
        t, k = topk_ids.shape
        rows = prepared.rows[topk_ids].reshape(-1)  # [T*k]
        parts = {n: p.index_select(0, rows) for n, p in self.pool.items()}  # [T*k, ...] each
        gate_up, down = self.fmt.unpack_many(parts, self.dtype)  # [T*k, 2I, H], [T*k, H, I]
        gate_up, down = gate_up.view(t, k, *gate_up.shape[1:]), down.view(t, k, *down.shape[1:])
        return batched_expert_mlp(x, gate_up, down, topk_ids, topk_weights, self.act)

    def _int4(
        self,
        prepared: Prepared,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        shared: torch.Tensor | None,
        shared_gate: torch.Tensor | None,
        settled: bool,
    ) -> torch.Tensor:
        """The int4 kernels: the rows read in place once their copies are in (gate_up's before down's); the
        shared expert added in the kernel that sums the choices (`KernelConfig.combine_shared`). Launch
        shapes: KernelConfig.int4_resident when `resident`, else .int4_decode (the two cases measured
        apart)."""
        from common.kernels import moe_int4  # Triton: CUDA

        fold = self.switches.kernels.combine_shared
        kernels = self.switches.kernels
        config = decode_config(x.shape[0], kernels.int4_resident if self.resident else kernels.int4_decode)
        out = moe_int4.moe_int4_decode(
            x, topk_ids, topk_weights, self.pool, config=config, kernels=kernels, row_of=prepared.rows,
            before_down=lambda: self.copies.join(prepared.done),  # down's rows come after gate_up's
            before_gate_up=lambda: self.copies.join(prepared.done, stage=0),
            shared=shared if fold else None, shared_gate=shared_gate if fold else None,
            settled=settled,
        )  # fmt: skip
        return out if fold else add_shared(out, shared, shared_gate)


class Lookahead:
    """Where a lookahead's guess and table update run (a stream beside the main one, with a side copy
    stream; else inline), and the gate on each layer's guessing."""

    def __init__(self, tables: CacheTables, device: torch.device, side: bool) -> None:
        self.tables, self.device = tables, device
        self.stream = torch.cuda.Stream(device) if side else None
        self.done: torch.cuda.Event | None = None
        """The last lookahead's table update, which the next resolution waits for."""
        self.seen = torch.zeros(2, tables.num_layers, dtype=torch.int64, device=device)
        """The guess counters at the last `gate`."""

    def join(self) -> None:
        """Make the current stream wait for the last lookahead's table update."""
        if self.done is not None:
            torch.cuda.current_stream(self.device).wait_event(self.done)
            self.done = None

    def run(self, x: torch.Tensor, work: Callable[[], None]) -> None:
        """`work` (which reads the hidden state `x`) after the main stream's work so far, on the stream."""
        self.join()  # one update at a time
        if self.stream is None:
            work()
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # fork: after the hidden state
        x.record_stream(self.stream)  # made on the main stream, read on this one
        with torch.cuda.stream(self.stream):
            work()
            self.done = torch.cuda.Event()
            self.done.record(self.stream)

    def gate(self, precision: float) -> None:
        """Between steps, as device ops (no sync): each layer that guessed since the last call copies its
        guesses in from now on if at least `precision` of them were requested (else it only keeps
        measuring them)."""
        counters, guessing = self.tables.counters, self.tables.guessing
        seen = torch.stack([counters["guesses"], counters["guesses_used"]])  # [2, L]
        made, used = (seen - self.seen).unbind()
        guessing.copy_(torch.where(made > 0, used >= precision * made, guessing))
        self.seen.copy_(seen)


class CacheDecode(ExpertPath):
    """Decode passes through the cache: hits read their slot; admitted misses are copied into their victim's
    slot, bypassed misses into a staging row, by one fixed-shape copy launch ([P] pairs, P = min(T·k, E))."""

    max_groups = DECODE_GROUPS

    def __init__(
        self,
        store: HostExpertStore,
        tables: CacheTables,
        copies: CopyStream,
        kernels: DecodeKernels,
        moved: torch.Tensor,
        step: torch.Tensor,
        ahead: Lookahead,
    ) -> None:
        """`moved`: the traffic counters ([TRAFFIC_ROWS, L]); `step`: the 0-d device step counter."""
        super().__init__(kernels)
        self.decode = kernels
        self.store, self.tables, self.copies, self.moved, self.step = store, tables, copies, moved, step
        self.switches, self.ahead = kernels.switches, ahead

    def prepare(self, i: int, topk_ids: torch.Tensor, group: int, groups: int) -> Prepared:
        e = self.store.num_experts
        check_group(topk_ids, e, groups)
        if self.switches.fused_resolve:
            from common.kernels.resolve import resolve_step  # Triton

            row, newcomer, target, valid = resolve_step(
                self.tables, i, topk_ids, self.step, self.moved, group=group, groups=groups,
                kernels=self.switches.kernels,
            )  # fmt: skip
            return self._copy_misses(i, row, newcomer, target, valid, topk_ids.shape[0], groups)
        requested = chosen(topk_ids, e)
        res = self.tables.resolve(i, requested, self.step, min(topk_ids.numel(), e), group, groups)
        self.moved[FILLS, i].add_(res.filled.sum())
        self.moved[BYPASSES, i].add_(res.bypass.sum())
        return self._copy_misses(i, res.row, res.newcomer, res.target, res.valid, topk_ids.shape[0], groups)

    def _copy_misses(
        self, i: int, row: torch.Tensor, newcomer: torch.Tensor, target: torch.Tensor, valid: torch.Tensor,
        tokens: int, groups: int,
    ) -> Prepared:  # fmt: skip
        """A step's resolution → its handle: the misses' copies launched."""
        done = self.copies.launch(i, newcomer, target, valid, self.decode.stages, groups > 1)
        return Prepared(rows=row, done=done)

    def lookahead(
        self, i: int, x: torch.Tensor, predict: Callable[[torch.Tensor], torch.Tensor], groups: int
    ) -> None:
        """Copy the experts `predict(x)` ([T, n] ids) guesses for MoE layer i into slots now
        (`CacheTables.prefetch`: the victims its misses would take, at most T·n of them), the guess and the
        table update on the lookahead's stream, the copies on the copy stream behind the misses already
        queued. Not in a grouped pass (a guess would be one group's)."""
        if groups > 1:
            return
        self.ahead.run(x, lambda: self._prefetch(i, predict(x)))

    def _prefetch(self, i: int, ids: torch.Tensor) -> None:
        """Table update and copy launch of a lookahead for MoE layer index i, on the current stream."""
        if self.switches.fused_resolve:
            from common.kernels.resolve import prefetch_step  # Triton

            newcomer, target, valid = prefetch_step(
                self.tables, i, ids, self.step, ids.numel(), kernels=self.switches.kernels
            )
        else:
            e = self.store.num_experts
            newcomer, target, valid = self.tables.prefetch(i, chosen(ids, e), self.step, ids.numel())
        self.copies.launch(i, newcomer, target, valid, background=True)
