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
from collections.abc import Callable
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
from common.workers.cache_freeze import CacheFreeze
from common.workers.grammar_waits import GrammarWaits
from common.workers.grants import StateGrants

log = logging.getLogger(__name__)


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
        self.engine = Engine(self.cfg, decode_worker=True, allocate=allocate, host_allocate=host_allocate)
        self.runner = self.engine.runner
        warm_up_on_cuda(self.runner)  # compile now, not on the first request's steps
        self.pool = self.runner.pool
        self.eos_ids = self.engine.config.eos_token_ids
        self.processors = self.engine.processors
        self.processors.start_grammars()  # the vocabulary's table, beside the warm-up and the first requests
        self.running: dict[str, Request] = {}
        self.admitting: GrammarWaits[Request] = GrammarWaits(
            self.processors, self.cfg.grammar_max_bytes, self.cfg.grammar_timeout_s
        )
        """Running requests whose sampling has not started: each waits for its own grammar's compile (on the
        grammars' thread, while the lanes step)."""
        self.grants = StateGrants(self.pool, self.cfg.max_running)
        self.freeze = CacheFreeze(self.engine.offload, self.cfg.lend_arena)
        self.copies_done: torch.cuda.Event | None = None
        """The end of the latest copies of a prompt's state to its siblings (CUDA): a grant waits for it."""
        self.stalled = False
        """The last step ran no lane: each waits for a page only a thaw can give (the loop may sleep)."""
        self.pipeline = DecodePipeline(self.runner)
        self.landed: list[Tokens] = []  # events of steps landed outside `step` (before a message)
        self.retiring: list[SequenceState] = []  # forgotten requests' states a launched step still uses

    # the grants' and the freeze's state, as the core's own (its tests read them)
    pending = property(lambda self: self.grants.pending)
    granted = property(lambda self: self.grants.granted)
    reserved = property(lambda self: self.grants.reserved)
    aborted = property(lambda self: self.grants.aborted)
    freezes = property(lambda self: self.freeze.holders)
    bank_ready = property(lambda self: self.freeze.bank_ready)

    # -- requests from prefill ------------------------------------------------------------------------------

    def alloc_state(self, msg: AllocState) -> list[StateGranted]:
        """Grant `msg` (and any earlier ask still waiting) what the pools can give now; refuse an ask for a
        prompt that leaves no room for a token, for a request already aborted, for one that already holds
        or awaits state (a duplicate would take a second lane and lose the first's), or for more siblings
        than lanes."""
        refusal = self.grants.refusal(msg, self.runner.max_context, self.running)
        if refusal is not None:
            return [StateGranted(msg.rid, -1, [], refusal)]
        self.grants.pending.append(msg)
        return self.grant_pending()

    def grant_pending(self) -> list[StateGranted]:
        """Grant the waiting asks, in order, while lanes and pages last (each grant freezes the cache); an
        ask with siblings takes their lanes and pages too, all or none."""
        grants = []
        if self.grants.fits(len(self.running)):
            self._settle()  # a freed state may come back; a launched step's copies end before the freeze
        while self.grants.fits(len(self.running)):
            grant = self.grants.grant_next()
            if grant is None:
                break
            self.set_freeze(grant.rid, True)  # the grant is the freeze's acknowledgement
            grants.append(grant)
        return grants

    def prefill_done(self, msg: PrefillDone) -> None:
        """Start decoding a request whose prompt state prefill has written, and its siblings, each from a
        copy of that state."""
        seq = self.grants.granted.get(msg.rid)
        if seq is None:  # aborted meanwhile
            log.info("PrefillDone for %s, which holds no state (aborted?)", msg.rid)
            self.set_freeze(msg.rid, False)
            return
        seq.num_cached, seq.rope_delta = msg.num_cached, msg.rope_delta
        offload = self.engine.offload
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
        if msg.rid in self.grants.aborted or msg.finished:  # the siblings' source only
            self.release(msg.rid)
        else:
            del self.grants.granted[msg.rid]
            self.set_freeze(msg.rid, False)
            self._start(msg, msg.rid, seq, msg.first_token, msg.seed)
        self._admit_ready()

    def _holds(self, rid: str) -> bool:
        """`rid` runs, or holds a granted or reserved state."""
        return rid in self.running or self.grants.holds(rid)

    def _start_siblings(self, msg: PrefillDone, seq: SequenceState) -> None:
        """Copy `seq` (the prompt's state) into each sibling that goes on, and free the others' states. The
        copies are queued on decode's stream, before any step or expert copy that could reuse their source or
        destinations once freed; prefill, which writes from another process, is granted a state only after
        them (`_settle`)."""
        reserved = self.grants.reserved
        try:
            for start in msg.siblings:
                if start.rid in reserved:  # (else aborted meanwhile)
                    state = reserved[start.rid][1]
                    self.pool.copy(seq, state)  # queued before any step of either
                    del reserved[start.rid]
                    self._start(msg, start.rid, state, start.first_token, start.seed)
        finally:
            if msg.siblings and self.runner.device.type == "cuda":
                self.copies_done = torch.cuda.Event()
                self.copies_done.record()
        self.grants.release_reserved(msg.rid)  # finished at their first token

    def _start(self, msg: PrefillDone, rid: str, seq: SequenceState, first_token: int, seed: int) -> None:
        """`rid` runs from its first token, once its sampling can start (`_admit_ready`)."""
        req = Request(msg.prompt_ids, msg.sampling, seed, seq, token_ids=[first_token], rid=rid)
        self.running[rid] = req
        self.admitting.add(rid, req, req.params)

    def _admit_ready(self) -> None:
        """Start sampling for the admitted requests that can start without waiting: their penalties' rows,
        their grammars (once compiled) and their first tokens on the device. One that cannot start at all
        (out of memory for the tables, a grammar over the budgets or that does not compile here) ends with
        an error event."""
        ready, failed = self.admitting.settle()
        for rid, _, failure in failed:
            log.error("%s: %s", rid, failure.error)
            self.landed.append(Tokens(rid, [], "error", error=failure.error, refused=failure.refused))
            self.release(rid)
        for rid, req, form in ready:
            try:
                self.processors.admit(req, form)
            except Exception as exc:
                log.exception("admitting %s failed", rid)
                self.landed.append(Tokens(rid, [], "error", error=f"its sampling could not start: {exc}"))
                self.release(rid)
                continue
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
        if rid in self.grants.reserved:
            self.release(rid)
            return []
        if rid in self.grants.granted:
            self.grants.aborted.add(rid)
            return []
        waiting = self.grants.waiting(rid)
        if not waiting and rid not in self.running:
            self.grants.gone.append(rid)
        self.release(rid)
        return [StateGranted(rid, -1, [], "aborted")] if waiting else []

    def release(self, rid: str) -> None:
        """Forget `rid` wherever it is (abort, or prefill finished it) and free its state: now, or once the
        launched steps that use it have landed (they still write its pages)."""
        seq = self.grants.forget(rid)
        req = self.running.pop(rid, None)
        self.admitting.drop(rid)
        self.set_freeze(rid, False)
        self.retiring += [state for state in (seq, req.state if req else None) if state is not None]
        self._free_landed()

    def set_freeze(self, holder: str, on: bool) -> None:
        """Start or end `holder`'s freeze of the expert cache (`CacheFreeze`). A freeze lands the launched
        steps first, so their copies have completed when it is granted."""
        if on:
            self._settle()
        self.freeze.set(holder, on)

    def prefill_restarted(self) -> None:
        """A (re)started prefill worker asks for the exports: what its predecessor held is released, and the
        bank is taken back and kept until one of the new worker's freezes ends (its warm-up writes its arena,
        unfrozen)."""
        self._settle()  # the bank's slots: no launched step reads them once the new worker may write them
        self.freeze.bank_ready = False
        for rid in [*self.grants.granted, *(ask.rid for ask in self.grants.pending)]:
            self.release(rid)
        self.freeze.take_bank()

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
        landed = self.pipeline.land()
        assert landed is not None, "landing with no launched step"
        lanes: list[Request] = landed.lanes
        tokens, rows = landed.tokens, landed.logprobs
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
        waiting: list[SequenceState] = []
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
        return LaneStats(len(self.running), len(self.grants.pending), self.pool.num_pages - free, free)
