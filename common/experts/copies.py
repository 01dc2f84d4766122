"""Host → device copies of expert rows into the pool: `copy_experts` (one fixed-shape copy list) and the
stream they run on (`CopyStream`). With a GPU-mapped store on CUDA the copies run on a side stream: forked
from the main stream once the copy list is resolved, joined right before the weights are read, so they
overlap with the main stream's work in between (the next layer's stream with this layer's compute; the
shared expert, run between `prepare` and `compute`). Elsewhere the copies run inline."""

from __future__ import annotations

import torch

from common.experts.store import HostExpertStore


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
        """One launch for all of an expert's components (set by `use_fused_kernels`,
        common/model/fused_kernels.py)."""

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

    def join(self, done: Copies, stage: int = -1) -> None:
        """Make the main stream wait for a launch's copies up to `stage` (default all), right before their
        rows are read."""
        if done is not None:
            torch.cuda.current_stream(done[stage].device).wait_event(done[stage])
