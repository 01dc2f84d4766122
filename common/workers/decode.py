"""DecodeCore: the decode worker's library half, steppable in-process.

It owns everything big on the device — resident weights, the per-request state pools and the expert cache
(through an `Engine`) — and the pools' allocators. Prefill asks it for a request's state (`AllocState`),
writes the prompt's state in place and hands the request over (`PrefillDone`); from then on every `step()`
decodes all running requests together (continuous batching over `max_running` lanes) and returns their new
tokens. An `AllocState` that finds no free lane or pages waits in a queue until a request finishes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from common.config import MemoryPlan, WorkerConfig
from common.engine.decode_pipeline import DecodePipeline
from common.engine.engine import Engine
from common.engine.memory_plan import worker_plan
from common.engine.runner import warm_up_on_cuda
from common.kv.state import Allocator, PoolExhausted, SequenceState
from common.protocol import AllocState, PrefillDone, StateGranted, Tokens
from common.sampling.requests import (
    Request,
    append_token,
    ends_by_length,
    host_logprobs,
    sample_on_device,
    top_logprobs,
)

GONE_RIDS = 4096
"""Aborted requests decode remembers without having seen them (their asks may still come)."""

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_engine(
    cfg: WorkerConfig,
    allocate: Allocator | None = None,
    host_allocate: Callable[[int], torch.Tensor] | None = None,
    arena_buffers: int = 2,
) -> Engine:
    """The model, state pools and expert cache a worker config describes (`allocate`, `host_allocate`,
    `arena_buffers`: see Engine)."""
    return Engine(
        cfg.model_dir,
        dtype=DTYPES[cfg.dtype],
        device=cfg.device,
        max_seqs=cfg.max_running,
        max_context=cfg.max_context,
        expert_cache=cfg.expert_cache,
        cache_policy=cfg.cache_policy,
        expert_format=cfg.expert_format,
        prefill_chunk=cfg.prefill_chunk,
        layer_major_tokens=cfg.layer_major_tokens,
        replay_routing=cfg.replay_routing,
        page_size=cfg.page_size,
        kv_dtype=cfg.kv_dtype,
        allocate=allocate,
        host_allocate=host_allocate,
        resident_dtype=cfg.resident_dtype,
        arena_buffers=arena_buffers,
        cuda_graphs=cfg.cuda_graphs,
        embeddings_on_host=cfg.embeddings_on_host,
        fused_kernels=cfg.fused_kernels,
        lend_kv=cfg.lend_kv,
        prefill_bank=cfg.lend_arena,
        lookahead=cfg.lookahead,
        kernels=cfg.kernels,
    )


def apply_memory_plan(cfg: WorkerConfig) -> tuple[WorkerConfig, MemoryPlan | None]:
    """With a `vram_budget`: the memory plan (ValueError when it is refused) and the config whose expert
    cache it sizes — offloaded, with the slots the plan leaves. Without one: `cfg` as it is, no plan."""
    if cfg.vram_budget is None:
        return cfg, None
    if cfg.expert_cache is not None:
        raise ValueError("give --vram-budget or --expert-cache, not both: the budget sizes the expert cache")
    plan = worker_plan(cfg)
    plan.check()
    return dataclasses.replace(cfg, expert_cache=str(plan.cache_slots)), plan


@dataclass
class LaneStats:
    """Occupancy, for heartbeats and metrics."""

    running: int
    waiting: int
    pages_used: int
    pages_free: int


class DecodeCore:
    """Continuous-batching decode over the state pools it owns."""

    def __init__(
        self,
        cfg: WorkerConfig,
        allocate: Allocator | None = None,
        host_allocate: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        self.cfg, self.plan = apply_memory_plan(cfg)  # the plan sized the expert cache (None: no budget)
        # prompts are prefilled by the prefill worker (its own arena): one buffer here, the other to the cache
        self.engine = load_engine(self.cfg, allocate, host_allocate, arena_buffers=1)
        self.runner = self.engine.runner
        warm_up_on_cuda(self.runner)  # compile now, not on the first request's steps
        self.pool = self.runner.pool
        self.eos_ids = self.engine.config.eos_token_ids
        self.processors = self.engine.processors
        self.processors.start_grammars()  # the vocabulary's table, beside the warm-up and the first requests
        self.running: dict[str, Request] = {}
        self.admitting: dict[str, tuple[Request, Future | None]] = {}
        """Running requests whose sampling has not started, with their grammars' compiles: each waits for
        its own (on the grammars' thread, while the lanes step)."""
        self.granted: dict[str, SequenceState] = {}  # state handed to prefill, not yet running
        self.reserved: dict[str, tuple[str, SequenceState]] = {}
        """Siblings' states (`AllocState.siblings`), granted with the request whose prompt they share: by the
        sibling's id, that request's id and the state, until its PrefillDone copies the prompt's into it."""
        self.copies_done: torch.cuda.Event | None = None
        """The end of the latest copies of a prompt's state to its siblings (CUDA): a grant waits for it."""
        self.pending: deque[AllocState] = deque()  # asks that wait for a free lane or pages
        self.freezes: set[str] = set()
        self.aborted: set[str] = set()  # granted, then aborted: the pages wait for prefill to give them back
        self.gone: deque[str] = deque(maxlen=GONE_RIDS)
        """Requests aborted before their ask arrived (the router's Abort and prefill's AllocState travel
        apart): an ask for one is refused, not granted to run unseen until max_tokens."""
        self.stalled = False
        """The last step ran no lane: each waits for a page only a thaw can give (the loop may sleep)."""
        self.pipeline = DecodePipeline(self.runner)
        self.landed: list[Tokens] = []  # events of steps landed outside `step` (before a message)
        self.retiring: list[SequenceState] = []  # forgotten requests' states a launched step still uses
        offload = getattr(self.engine, "offload", None)
        if offload is not None:  # prefill reads the cache in place while frozen
            offload.tables.readers = True
        self.bank_ready = False
        """With `lend_arena`: the bank (prefill's arena) is lent whenever the last freeze ends, once the
        running prefill worker has been granted one (it asks for state only after its warm-up, which writes
        its arena unfrozen). A (re)started prefill sets it back (`prefill_restarted`)."""

    # -- requests from prefill ------------------------------------------------------------------------------

    def alloc_state(self, msg: AllocState) -> list[StateGranted]:
        """Grant `msg` (and any earlier ask still waiting) what the pools can give now; refuse an ask for a
        prompt that leaves no room for a token, for a request already aborted, for one that already holds
        or awaits state (a duplicate would take a second lane and lose the first's), or for more siblings
        than lanes."""
        refusal = None
        if msg.num_tokens >= self.runner.max_context:
            refusal = (
                f"prompt of {msg.num_tokens} tokens leaves no room in a context of {self.runner.max_context}"
            )
        elif msg.rid in self.gone:
            refusal = "aborted"
        elif any(self._holds(rid) or self._asked(rid) for rid in [msg.rid, *msg.siblings]):
            refusal = "a request with this id already holds state"
        elif _lanes(msg) > self.cfg.max_running:
            refusal = (
                f"{_lanes(msg)} choices of one prompt need as many lanes; decode has {self.cfg.max_running}"
            )
        if refusal is not None:
            return [StateGranted(msg.rid, -1, [], refusal)]
        self.pending.append(msg)
        return self.grant_pending()

    def grant_pending(self) -> list[StateGranted]:
        """Grant the waiting asks, in order, while lanes and pages last (each grant freezes the cache); an
        ask with siblings takes their lanes and pages too, all or none."""
        grants = []
        if self.pending and self._lanes_used() + _lanes(self.pending[0]) <= self.cfg.max_running:
            self._settle()  # a freed state may come back; a launched step's copies end before the freeze
        while self.pending and self._lanes_used() + _lanes(self.pending[0]) <= self.cfg.max_running:
            ask = self.pending[0]
            siblings = [rid for rid in ask.siblings if rid not in self.gone]  # not aborted already
            states = self._new_states(1 + len(siblings), ask.num_tokens)
            if states is None:
                break
            self.pending.popleft()
            seq, *copies = states
            self.granted[ask.rid] = seq
            self.reserved.update({rid: (ask.rid, state) for rid, state in zip(siblings, copies, strict=True)})
            self.set_freeze(ask.rid, True)  # the grant is the freeze's acknowledgement
            grants.append(StateGranted(ask.rid, seq.slot, list(seq.pages)))
        return grants

    def _new_states(self, count: int, num_tokens: int) -> list[SequenceState] | None:
        """`count` new states with pages for `num_tokens` each, or None (and nothing taken) when the pools
        cannot give them all now (a slot may still be retiring)."""
        states: list[SequenceState] = []
        try:
            for _ in range(count):
                states.append(self.pool.new_sequence())
                self.pool.reserve(states[-1], num_tokens)
        except PoolExhausted:
            for state in states:
                self.pool.release(state)
            return None
        return states

    def _lanes_used(self) -> int:
        return len(self.running) + len(self.granted) + len(self.reserved)

    def _holds(self, rid: str) -> bool:
        """`rid` runs, or holds a granted or reserved state."""
        return rid in self.running or rid in self.granted or rid in self.reserved

    def _asked(self, rid: str) -> bool:
        """A waiting ask names `rid`, as its request or a sibling."""
        return any(a.rid == rid or rid in a.siblings for a in self.pending)

    def prefill_done(self, msg: PrefillDone) -> None:
        """Start decoding a request whose prompt state prefill has written, and its siblings, each from a
        copy of that state."""
        seq = self.granted.get(msg.rid)
        if seq is None:  # aborted meanwhile
            log.info("PrefillDone for %s, which holds no state (aborted?)", msg.rid)
            self.set_freeze(msg.rid, False)
            return
        seq.num_cached, seq.rope_delta = msg.num_cached, msg.rope_delta
        offload = getattr(self.engine, "offload", None)
        if msg.routing and offload is not None:  # the prompt's routing: the cache's rates count it
            stats = torch.frombuffer(bytearray(msg.routing), dtype=torch.float32)
            offload.tables.add_statistics(stats.view(offload.tables.num_layers, -1))
        try:
            self._start_siblings(msg, seq)
        except Exception as exc:  # out of memory for a copy's temporaries: the prompt's choices end here
            log.exception("copying %s's state to its siblings failed", msg.rid)
            error = f"its state could not be copied: {exc}"
            for rid in [msg.rid, *(start.rid for start in msg.siblings if self._holds(start.rid))]:
                self.landed.append(Tokens(rid, [], "error", error=error))
                self.release(rid)
            return
        if msg.rid in self.aborted or msg.finished:  # the siblings' source only
            self.release(msg.rid)
        else:
            del self.granted[msg.rid]
            self.set_freeze(msg.rid, False)
            self._start(msg, msg.rid, seq, msg.first_token, msg.seed)
        self._admit_ready()

    def _start_siblings(self, msg: PrefillDone, seq: SequenceState) -> None:
        """Copy `seq` (the prompt's state) into each sibling that goes on, and free the others' states. The
        copies are queued on decode's stream, before any step or expert copy that could reuse their source or
        destinations once freed; prefill, which writes from another process, is granted a state only after
        them (`_settle`)."""
        try:
            for start in msg.siblings:
                if start.rid in self.reserved:  # (else aborted meanwhile)
                    state = self.reserved[start.rid][1]
                    self.pool.copy(seq, state)  # queued before any step of either
                    del self.reserved[start.rid]
                    self._start(msg, start.rid, state, start.first_token, start.seed)
        finally:
            if msg.siblings and self.runner.device.type == "cuda":
                self.copies_done = torch.cuda.Event()
                self.copies_done.record()
        for rid in [rid for rid, (owner, _) in self.reserved.items() if owner == msg.rid]:
            self.pool.release(self.reserved.pop(rid)[1])  # finished at their first token

    def _start(self, msg: PrefillDone, rid: str, seq: SequenceState, first_token: int, seed: int) -> None:
        """`rid` runs from its first token, once its sampling can start (`_admit_ready`)."""
        req = Request(msg.prompt_ids, msg.sampling, seed, seq, token_ids=[first_token], rid=rid)
        self.running[rid] = req
        self.admitting[rid] = (req, self.processors.prepare(req.params))

    def _admit_ready(self) -> None:
        """Start sampling for the admitted requests that can start without waiting: their penalties' rows,
        their grammars (once compiled) and their first tokens on the device. One that cannot start at all
        (out of memory for the tables, a grammar that does not compile here) ends with an error event."""
        for rid, (req, form) in list(self.admitting.items()):
            if form is not None and not form.done():
                continue
            try:
                self.processors.admit(req, form)
            except Exception as exc:
                log.exception("admitting %s failed", rid)
                self.landed.append(Tokens(rid, [], "error", error=f"its sampling could not start: {exc}"))
                self.release(rid)
                continue
            del self.admitting[rid]
            self.pipeline.seed([req.state], [req.token_ids[-1]])  # its first step reads it on the device

    @property
    def compiling(self) -> bool:
        """Whether a request waits for its grammar's compile (the loop then waits briefly for messages)."""
        return bool(self.admitting)

    def abort(self, rid: str) -> list[StateGranted]:
        """The router's abort. A request prefill holds keeps its pages (and prefill its freeze) until
        prefill, which may be writing them in this moment, gives them back (`ReleaseState`, `PrefillDone`):
        freed now, they could be granted again, or lent to the expert cache, under its writes. An ask still
        waiting is answered (refused), so that prefill stops waiting for it; a request not seen yet is
        remembered, so that its ask, when it comes, is refused. A sibling's reserved state is freed at once
        (prefill does not write it)."""
        if rid in self.reserved:
            self.release(rid)
            return []
        if rid in self.granted:
            self.aborted.add(rid)
            return []
        waiting = self._waiting(rid)
        if not waiting and rid not in self.running:
            self.gone.append(rid)
        self.release(rid)
        return [StateGranted(rid, -1, [], "aborted")] if waiting else []

    def _waiting(self, rid: str) -> bool:
        """`rid`'s ask waits for a lane or pages."""
        return any(a.rid == rid for a in self.pending)

    def release(self, rid: str) -> None:
        """Forget `rid` wherever it is (abort, or prefill finished it) and free its state: now, or once the
        launched steps that use it have landed (they still write its pages)."""
        self.aborted.discard(rid)
        self.pending = deque(a for a in self.pending if a.rid != rid)
        seq = self.granted.pop(rid, None)
        req = self.running.pop(rid, None)
        self.admitting.pop(rid, None)
        for sibling in [s for s, (owner, _) in self.reserved.items() if rid in (s, owner)]:  # never started
            self.pool.release(self.reserved.pop(sibling)[1])
        self.set_freeze(rid, False)
        self.retiring += [state for state in (seq, req.state if req else None) if state is not None]
        self._free_landed()

    def set_freeze(self, holder: str, on: bool) -> None:
        """Prefill reads the expert cache in place while it holds a freeze (from the grant of its state to
        `Thaw`, `PrefillDone` or the request's end): no insertions or evictions meanwhile. A freeze lands the
        launched steps first, so their copies have completed when it is granted."""
        if on:
            self._settle()
        was = bool(self.freezes)
        (self.freezes.add if on else self.freezes.discard)(holder)
        offload = getattr(self.engine, "offload", None)
        if offload is None:
            return
        if self.freezes and not was:
            self._take_bank()  # prefill copies its experts there from the grant on
        self.bank_ready |= on  # a grant: the prefill that asked for it is past its warm-up
        offload.tables.frozen = bool(self.freezes)
        if was and not self.freezes and self.bank_ready and self.cfg.lend_arena:
            offload.tables.lend()

    def prefill_restarted(self) -> None:
        """A (re)started prefill worker asks for the exports: what its predecessor held is released, and the
        bank is taken back and kept until one of the new worker's freezes ends (its warm-up writes its arena,
        unfrozen)."""
        self._settle()  # the bank's slots: no launched step reads them once the new worker may write them
        self.bank_ready = False
        for rid in [*self.granted, *(ask.rid for ask in self.pending)]:
            self.release(rid)
        self._take_bank()

    def _take_bank(self) -> None:
        """With `lend_arena`: evict the cache from prefill's arena rows (landed on the device before a grant
        or the exports let prefill write them: the tables have readers)."""
        offload = getattr(self.engine, "offload", None)
        if self.cfg.lend_arena and offload is not None:
            offload.tables.reclaim()

    # -- stepping -------------------------------------------------------------------------------------------

    def step(self) -> list[Tokens]:
        """Launch a decode step for every running request that takes one, then land the step before it: its
        events (and those of a step landed meanwhile), a finished request's last. A step's tokens reach the
        host while the next step runs (common/engine/decode_pipeline.py)."""
        self._admit_ready()
        while any(r.params.structure and self.pipeline.ahead(r) for r in self.running.values()):
            self._land()  # a grammar reads its lane's token before the next mask: land now, not a step later
        reqs = [r for r in self.running.values() if self._takes_step(r) and self._next_page(r)]
        self.stalled = bool(self.running) and not reqs and not self.pipeline.launched
        if reqs:
            ahead = [int(self.pipeline.ahead(r)) for r in reqs]

            def pick(logits: torch.Tensor) -> torch.Tensor:
                return sample_on_device(logits, reqs, self.processors, ahead)

            self.pipeline.launch(reqs, [r.state for r in reqs], pick, top_logprobs(reqs))
        launched = len(self.pipeline.launched)
        if launched >= self.pipeline.depth or (launched and not reqs):
            self._land()
        events, self.landed = self.landed, []
        return events

    @property
    def busy(self) -> bool:
        """Whether a step has work: a running request that can take one, a launched step to land, or events
        of a step landed outside `step` (a grant lands the steps in flight) to hand out."""
        return (bool(self.running) and not self.stalled) or bool(self.pipeline.launched or self.landed)

    def fail(self, error: str) -> list[Tokens]:
        """After a failed step: every running request ends with an error event, and its state is freed (the
        launched steps are forgotten, their tokens lost with the requests, once the device is done with them:
        their pages may be granted again right after). Not a retry of each lane alone to find the one at
        fault: the failed step may have advanced recurrent states (Gated DeltaNet's, the convs') in place, so
        a retried step would compute from corrupted state; the API bounds every per-request value instead."""
        self.pipeline.abandon()
        errors = [Tokens(rid, [], "error", error=error) for rid in list(self.running)]
        for event in errors:
            self.release(event.rid)
        events, self.landed = self.landed, []
        return events + errors

    def _takes_step(self, req: Request) -> bool:
        """Whether `req` gets a token from a step launched now: not when its token in flight (if any) ends
        it by length — known on the host, so no step is launched for nothing. (A structured request is
        never in flight here: `step` lands its pass first, for its grammar to read the token.) Not while its
        sampling has not started."""
        if req.rid in self.admitting:
            return False
        if not self.pipeline.ahead(req):
            return True
        cached = req.state.num_cached
        return not ends_by_length(req, self.runner.max_context, len(req.token_ids) + 1, cached)

    def _land(self) -> None:
        """Land the oldest launched step: its tokens become events (in `landed`, for the next `step` to
        return); a request it finishes is forgotten (its state freed once no launched step uses it)."""
        lanes, tokens, rows = self.pipeline.land()
        asked = [req.params.logprobs for req in lanes]
        logprobs = [None] * len(lanes) if rows is None else host_logprobs(*rows, asked)
        for req, token, lp in zip(lanes, tokens, logprobs, strict=True):
            if req.finish_reason or self.running.get(req.rid) is not req:
                continue  # finished by the step before, or aborted: a token no one asked for
            ahead = int(self.pipeline.ahead(req))
            try:
                self.processors.accept(req, token)
            except RuntimeError as exc:  # its grammar refused the token: this request ends, the others go on
                log.error("%s: %s", req.rid, exc)
                self.landed.append(Tokens(req.rid, [], "error", error=str(exc), index=len(req.token_ids)))
                self.release(req.rid)
                continue
            done = append_token(req, token, self.eos_ids, self.runner.max_context, ahead)
            listed = [] if lp is None else [lp]
            index = len(req.token_ids) - 1
            self.landed.append(Tokens(req.rid, [token], req.finish_reason, index=index, logprobs=listed))
            if done:
                self.release(req.rid)
        self._free_landed()

    def _settle(self) -> None:
        """Land every launched step, and wait for the state copies to siblings: before a message changes what
        the lanes hold or the cache may do (a grant's freeze must find the steps' copies done; a freed state
        no step in flight still writes, and no copy still reads or writes)."""
        while self.pipeline.launched:
            self._land()
        if self.copies_done is not None:
            self.copies_done.synchronize()
            self.copies_done = None

    def _free_landed(self) -> None:
        """Free the states of forgotten requests that no launched step uses any more."""
        waiting = []
        for state in self.retiring:
            (waiting.append if self.pipeline.uses(state) else self.pool.release)(state)
        self.retiring = waiting

    def _next_page(self, req: Request) -> bool:
        """Whether `req`'s next token has its page. With KV lending it may not, for a while: a page past the
        limit cannot be taken back from the expert cache while prefill reads it (the lane waits a step)."""
        try:
            self.pool.reserve(req.state, req.state.num_cached + 1)
        except PoolExhausted:
            return False
        return True

    def stats(self) -> LaneStats:
        free = self.pool.pages.num_free
        return LaneStats(len(self.running), len(self.pending), self.pool.num_pages - free, free)


def _lanes(ask: AllocState) -> int:
    """Lanes an ask takes: its request's and its siblings'."""
    return 1 + len(ask.siblings)
