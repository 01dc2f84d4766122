"""CUDA graphs of decode passes: a lane count's whole decode pass recorded once, replayed every step after.

Why: an offloaded MoE decode step is thousands of small kernels; launched one by one from Python it is bound
by the host. Recorded, a step is one launch.

A recordable pass (what every layer on the decode path keeps to): fixed shapes, no host synchronisation, no
host value copied to the device inside the pass, every value that changes between steps read from device
memory. The recording reads a static ForwardBatch (`static_kv` set: shapes from the runner's context bound,
lengths from `positions`); each replay first copies the step's batch into it. The expert cache's recency
stamp, freeze flag and slot partition, and the routing replayer's cursor, are device tensors for this
reason. Host-side bookkeeping (page reservation, the providers' `begin_pass`, the cache's rebalance) runs
between replays.
"""

from __future__ import annotations

import torch
from torch import nn

from common.engine.model_api import CausalLM, as_causal_lm
from common.kernels.config import KERNELS
from common.kv.batch import ForwardBatch
from common.model.context import ForwardContext
from common.model.groups import lane_groups, pass_groups


class _Recorded:
    """One recorded decode pass over `lanes` sequences: its static inputs, graph and logits."""

    def __init__(self, lanes: int, max_context: int, page_size: int, device: torch.device) -> None:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        self.batch = ForwardBatch(
            input_ids=zeros(lanes),
            position_pair=zeros(2, lanes),
            seq_index=torch.arange(lanes, device=device),
            query_lens=[1] * lanes,
            cache_lens=[1] * lanes,
            page_table=zeros(lanes, -(-max_context // page_size)),
            slot_ids=zeros(lanes),
            page_size=page_size,
            slot_mapping=zeros(lanes),
            static_kv=max_context,
        )
        self.graph = torch.cuda.CUDAGraph()
        self.logits: torch.Tensor | None = None  # [lanes, V] fp32, rewritten by each replay
        self.groups: list[ForwardBatch] = [self.batch]  # the lanes' groups (common/model/groups.py)

    def load(self, batch: ForwardBatch) -> None:
        """Copy a step's batch into the static inputs (page-table columns past its width keep old page ids:
        they are only read for keys a query may not see)."""
        static = self.batch
        for name in ("input_ids", "position_pair", "slot_ids", "slot_mapping"):
            getattr(static, name).copy_(getattr(batch, name), non_blocking=True)
        static.page_table[:, : batch.page_table.shape[1]].copy_(batch.page_table, non_blocking=True)


class DecodeGraphs:
    """The recorded decode passes of one model and state pool, one per lane count.

    `run(batch, eager)` serves a decode batch: the first batch of B sequences runs `eager()` (the step's
    real output) on a side stream — which also warms up the libraries a recording may not initialise —
    and then records the pass for B lanes; later batches of B sequences replay it. The returned logits
    [B, V] are the recording's buffer: valid until the next replay of that lane count.
    """

    def __init__(self, model: nn.Module, pool, backend, max_context: int) -> None:
        self.model: CausalLM = as_causal_lm(model)
        self.module = model  # the same model, as `pass_groups` takes it
        self.pool, self.backend, self.max_context = pool, backend, max_context
        self.recorded: dict[int, _Recorded] = {}
        self.memory = torch.cuda.graph_pool_handle()  # one private pool: passes never run concurrently

    def forget(self) -> None:
        """Drop the recordings: the next batches record again, after a change to what a step runs (a kernel
        switched on or off). They record into a new private pool: the old one is released once its last
        graph is gone, and torch's allocator refuses a capture into a pool it has released."""
        self.recorded.clear()
        self.memory = torch.cuda.graph_pool_handle()

    def run(self, batch: ForwardBatch, eager) -> torch.Tensor:
        lanes = batch.input_ids.shape[0]
        rec = self.recorded.get(lanes)
        if rec is not None:
            self.model.experts.regroup(len(rec.groups))  # (an eager pass is one group: ModelRunner)
            rec.load(batch)
            rec.graph.replay()
            assert rec.logits is not None  # set by the recording
            return rec.logits
        logits = self._warm(eager)
        self.recorded[lanes] = self._record(lanes, batch.input_ids.device)
        return logits

    @staticmethod
    def _warm(eager) -> torch.Tensor:
        side, main = torch.cuda.Stream(), torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            logits = eager()
        main.wait_stream(side)
        return logits

    def _record(self, lanes: int, device: torch.device) -> _Recorded:
        rec = _Recorded(lanes, self.max_context, self.pool.page_size, device)
        groups = self.groups(lanes)
        if groups > 1:  # the groups' batches are static inputs too (their own lane index): kept with it
            rec.groups = [rec.batch.lanes(a, b) for a, b in lane_groups(lanes, groups)]
        # thread_local: other threads of a worker (metrics, heartbeats) may touch CUDA meanwhile
        with torch.cuda.graph(rec.graph, pool=self.memory, capture_error_mode="thread_local"):
            if len(rec.groups) > 1:
                hidden = self.model.forward_groups([self._context(b) for b in rec.groups])
            else:
                hidden = self.model(self._context(rec.batch))
            rec.logits = self.model.compute_logits(hidden)  # one token per lane: all are last
        return rec

    def groups(self, lanes: int) -> int:
        """Groups a pass of `lanes` lanes is recorded as (`pass_groups`)."""
        kernels = getattr(self.module, "kernels", KERNELS)  # (configure_kernels)
        return pass_groups(self.module, lanes, kernels.split_lanes)

    def _context(self, batch: ForwardBatch) -> ForwardContext:
        return ForwardContext(batch, self.pool, self.backend, self.backend.plan(batch))
