"""PrefillCore: the prefill worker's library half, steppable in-process.

It runs prompts on decode's weights and writes their state straight into decode's pools (both mapped, never
copied), one pass per `step()` (a chunk, or a layer-major group of chunks) so an abort waits at most one
pass. Per request: ask decode for state (`AllocState`; granting it also freezes decode's expert cache, which
prefill reads in place), run the passes, sample the first token, send it to the router and hand the request
to decode (`PrefillDone`, which ends the freeze) — or, when the first token already ends it, give the state
back. One request is prefilled at a time, in arrival order; a request whose prompt has images joins the queue
once the encoder's embeddings of them came (common/workers/image_waits.py), and a structured one once its
grammar has compiled (common/workers/grammar_waits.py): the others are prefilled meanwhile.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from common.config import WorkerConfig
from common.engine.runner import ModelRunner, warm_up_on_cuda
from common.experts.cache_tables import CacheTables
from common.ipc.hostmem import host_list_to
from common.kernels import fused_by_default
from common.kv.state import SequenceState
from common.model.fused_kernels import configure_kernels, use_fused_kernels
from common.model.qwen4_exp.positions import ImageTokens
from common.protocol import (
    AllocState,
    Generate,
    ImagesEncoded,
    Message,
    PrefillDone,
    ReleaseState,
    SiblingStart,
    StateGranted,
    Thaw,
    TokenLogprobs,
    Tokens,
)
from common.sampling.logit_processors import LogitProcessors
from common.sampling.requests import Request, append_token, host_logprobs, sample_with_logprobs
from common.sampling.sampler import logprobs_of
from common.text.tokenizer import Tokenizer
from common.workers.grammar_waits import GrammarWaits
from common.workers.image_waits import ImageWaits

Outgoing = list[tuple[str, Message]]
"""Messages to send, each with its destination service (`router`, `decode` or `encoder`)."""

log = logging.getLogger(__name__)

PROMPT_LOGPROB_ROWS = 256
"""Prompt positions whose logits are made at once for their log-probabilities ([rows, V] fp32 each)."""


def _meta(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")  # replaced by decode's tensors (attach)


@dataclass
class PrefillJob:
    """The request being prefilled."""

    gen: Generate
    seq: SequenceState
    seed: int
    done: int = 0
    """Prompt tokens already run."""
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    """Those of the prompt's tokens after the first so far (`SamplingParams.prompt_logprobs`)."""
    siblings: list[tuple[str, int]] = field(default_factory=list)
    """`gen.siblings` with the seeds they sample at (drawn for those that named none)."""


class PrefillCore:
    """Chunked prefill into state that decode owns."""

    def __init__(
        self,
        cfg: WorkerConfig,
        model: torch.nn.Module,
        pool_tensors: dict[str, torch.Tensor],
        eos_ids,
        image_tokens: ImageTokens | None = None,
    ) -> None:
        """`image_tokens`: how the model's prompts carry images (None: it takes none)."""
        self.cfg = cfg
        self.runner = ModelRunner(
            model,
            cfg.max_running,
            cfg.max_context,
            cfg.page_size,
            kv_dtype=cfg.kv_dtype,
            allocate=_meta,
            kv_scales=torch.ones(1),  # placeholder (skips calibration): attach brings decode's scales
        )
        self.runner.pool.attach(pool_tensors)
        if fused_by_default(cfg.fused_kernels, self.runner.device):
            # decode fused the projections before sharing them: view its weights, copy nothing
            use_fused_kernels(model, True, self.runner.backend, fuse_copy=False)
        configure_kernels(model, cfg.kernels, self.runner.backend)  # after the fusion: its projections too
        warm_up_on_cuda(self.runner)  # compile now, not in the first request's TTFT
        self.eos_ids = eos_ids
        self.processors = LogitProcessors.for_runner(self.runner, eos_ids, Tokenizer.from_dir(cfg.model_dir))
        self.processors.start_grammars()
        self.grammars: GrammarWaits[Generate] = GrammarWaits(
            self.processors, cfg.grammar_max_bytes, cfg.grammar_timeout_s
        )
        """Structured requests waiting for their grammar's compile, before they join `queue`."""
        self.forms: dict[str, Future] = {}
        """The compiled grammar of each structured request past `grammars`, for its first token."""
        self.tables: CacheTables | None = getattr(model.experts, "tables", None)
        """This worker's own expert-cache tables (no slots: decode's cache is read in place), which observe
        each prompt's routing for decode."""
        self.queue: deque[Generate] = deque()
        self.asked: Generate | None = None  # waiting for decode's StateGranted
        self.dropped: set[str] = set()  # aborted while asked: give the grant back
        self.cut: set[str] = set()
        """Siblings aborted while their prompt is held here: they sample no first token."""
        self.job: PrefillJob | None = None
        dtype = next(model.parameters()).dtype
        self.images = ImageWaits(image_tokens, self.runner.device, dtype)

    @property
    def busy(self) -> bool:
        return self.job is not None

    @property
    def compiling(self) -> bool:
        """Whether a request waits for its grammar's compile (the loop then looks again soon: the compile's
        end is no message)."""
        return bool(self.grammars)

    def submit(self, gen: Generate) -> Outgoing:
        # The router's ids are unique: a second Generate for one is a resent message.
        if any(g.rid == gen.rid for g in self._held()):
            log.warning("ignoring a second Generate for %s", gen.rid)
            return []
        if gen.images:
            ready, out = self.images.request(gen)
            return out + self._enqueue(ready)
        return self._enqueue([gen])

    def images_encoded(self, msg: ImagesEncoded) -> Outgoing:
        """The encoder's embeddings of a request's images (copied here; their rows go back at once)."""
        ready, out = self.images.images(msg)
        return out + self._enqueue(ready)

    def _enqueue(self, gens: list[Generate]) -> Outgoing:
        for gen in gens:  # a grammar compiles (on the grammars' thread) while the others are prefilled
            if gen.sampling.structure:
                self.grammars.add(gen.rid, gen, gen.sampling)
            else:
                self.queue.append(gen)
        return self._compiled()

    def _compiled(self) -> Outgoing:
        """Queue the structured requests whose grammar has compiled; end those that failed (over a budget:
        refused, a 400)."""
        ready, failed = self.grammars.settle()
        out: Outgoing = []
        for rid, gen, form in ready:
            self.queue.append(gen)
            if form is not None:
                self.forms[rid] = form
        for _, gen, failure in failed:
            out += self._errors(gen, failure.error, refused=failure.refused)
        return out + self._ask()

    def _held(self) -> list[Generate]:
        """Every request this core holds: waiting for its images or its grammar, queued, asked for,
        prefilling."""
        return [
            *self.images.held(),
            *self.grammars.held(),
            *self.queue,
            *([self.asked] if self.asked else []),
            *([self.job.gen] if self.job else []),
        ]

    def _ask(self) -> Outgoing:
        if self.asked is not None or self.job is not None or not self.queue:
            return []
        self.asked = self.queue.popleft()
        siblings = [s.rid for s in self.asked.siblings if s.rid not in self.cut]  # a lane each
        return [("decode", AllocState(self.asked.rid, len(self.asked.prompt_ids), siblings))]

    def granted(self, msg: StateGranted) -> Outgoing:
        if msg.rid in self.dropped:
            self.dropped.discard(msg.rid)
            return [("decode", ReleaseState(msg.rid))] if msg.slot >= 0 else []
        if self.asked is None or self.asked.rid != msg.rid:  # not asked by this core (decode restarted and
            # granted what the core before it asked): give it back, or its freeze would hold for good
            return [("decode", ReleaseState(msg.rid))] if msg.slot >= 0 else []
        gen, self.asked = self.asked, None
        if msg.slot < 0:
            self.images.forget(gen.rid)
            return [*self._errors(gen, msg.error), *self._ask()]
        seq = SequenceState(msg.slot, list(msg.pages))
        images = self.images.take(gen.rid)
        if images is not None:
            seq.images, seq.rope_delta = images
        siblings = [(s.rid, _seed(s.seed)) for s in gen.siblings]
        self.job = PrefillJob(gen, seq, _seed(gen.sampling.seed), siblings=siblings)
        if self.tables is not None:  # this prompt's routing only (PrefillDone.routing)
            self.tables.clear_statistics()
        return []

    def abort(self, rid: str) -> Outgoing:
        """Forget `rid`. A sibling is cut from its prompt; the siblings of a request aborted here end with an
        error (the router aborts a request's choices together: theirs are for nobody, but never hang)."""
        if any(rid in (s.rid for s in gen.siblings) for gen in self._held()):
            self.cut.add(rid)
            return []
        held = [g for g in self._held() if g.rid == rid]
        errors = (
            self._errors(held[0], "aborted with the choice it shares its prompt with", rid) if held else []
        )
        self.images.forget(rid)
        self.grammars.drop(rid)
        self.queue = deque(g for g in self.queue if g.rid != rid)
        if self.asked is not None and self.asked.rid == rid:
            self.asked = None
            self.dropped.add(rid)
            return errors + self._ask()
        if self.job is not None and self.job.gen.rid == rid:
            self.job = None
            self._settle()
            return [*errors, ("decode", Thaw(rid)), ("decode", ReleaseState(rid)), *self._ask()]
        return errors

    def _errors(self, gen: Generate, error: str, but: str = "", refused: bool = False) -> Outgoing:
        """An error event for `gen` and each of its siblings (less any cut, and `but`), which this core
        drops: its cut siblings and its grammar are forgotten. `refused`: the request is at fault (a 400)."""
        rids = [gen.rid, *(s.rid for s in gen.siblings if s.rid not in self.cut)]
        self.cut.difference_update(s.rid for s in gen.siblings)
        self.forms.pop(gen.rid, None)
        events = [Tokens(rid, [], "error", error=error, refused=refused) for rid in rids if rid != but]
        return [("router", event) for event in events]

    def _settle(self) -> None:
        """Wait for this worker's queued GPU work before a Thaw or a release: decode may then lend the arena's
        rows (--lend-arena) or the pages to others, which copies or kernels still queued would write. (A
        finished prompt's sampling has synchronised already.) A sticky CUDA error raises here: the worker
        ends, and its successor's WantExports gives everything back."""
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)

    def fail_all(self, error: str) -> Outgoing:
        """Every request this worker holds ends with an error (decode restarted: their state is gone)."""
        out = [event for gen in self._held() for event in self._errors(gen, error)]
        self.images.clear()
        self.grammars.clear()
        self.forms.clear()
        self.queue.clear()
        self.asked = self.job = None
        self.dropped.clear()
        self.cut.clear()
        return out

    def step(self) -> Outgoing:
        """The structured requests whose grammar has compiled join the queue; then the next pass of the
        current request runs (`_pass`)."""
        return (self._compiled() if self.grammars else []) + self._pass()

    def _pass(self) -> Outgoing:
        """Run the next pass of the current request — a chunk, or a layer-major group of chunks (see
        LAYER_MAJOR_TOKENS; a prompt whose log-probabilities are asked for goes a chunk at a time); after
        its last, hand it on."""
        job = self.job
        if job is None:
            return []
        prompt, chunk = job.gen.prompt_ids, self.cfg.prefill_chunk
        top = job.gen.sampling.prompt_logprobs
        group = chunk if top is not None else max(chunk, self.cfg.layer_major_tokens)
        piece = prompt[job.done : job.done + group]
        if top is not None:  # every token's logits, a slice at a time
            hidden = self.runner.forward_hidden(job.seq, piece)  # [T, H]
            targets = prompt[job.done + 1 : job.done + len(piece) + 1]
            job.prompt_logprobs += self._scored(hidden[: len(targets)], targets, top)
            logits = self.runner.model.compute_logits(hidden[-1:])  # [1, V]
        elif len(piece) > chunk:
            bound = job.seq.num_cached - job.done + len(prompt)  # the whole prompt's keys
            logits = self.runner.prefill_layer_major(job.seq, piece, chunk, bound)  # [1, V]
        else:
            logits = self.runner.forward([job.seq], [piece])  # [1, V]
        job.done += len(piece)
        if job.done < len(prompt):
            return []
        self.job = None
        try:
            return self._finish(job, logits)
        except Exception:
            self.job = job  # the worker's failure path aborts it: its freeze and pages go back
            raise

    def _scored(self, hidden: torch.Tensor, targets: list[int], top: int) -> list[TokenLogprobs]:
        """The log-probabilities of `targets` (the next prompt tokens) under hidden states [N, H], and the
        `top` best alternatives', PROMPT_LOGPROB_ROWS rows of logits at a time."""
        out: list[TokenLogprobs] = []
        for at in range(0, len(targets), PROMPT_LOGPROB_ROWS):
            logits = self.runner.model.compute_logits(hidden[at : at + PROMPT_LOGPROB_ROWS])  # [n, V]
            wanted = host_list_to(targets[at : at + PROMPT_LOGPROB_ROWS], logits.device)
            rows = host_logprobs(*logprobs_of(logits, wanted, top), [top] * len(wanted))
            out += [row for row in rows if row is not None]  # (none is: each asked for `top`)
        return out

    def _finish(self, job: PrefillJob, logits: torch.Tensor) -> Outgoing:
        """Sample the first token of the request and of each of its siblings (their own seeds, one prompt's
        logits), send them to the router, and hand the state to decode: to decode from, or to copy for the
        siblings that go on, or back when every one has ended."""
        gen = job.gen
        n = len(gen.prompt_ids)
        job.seq.images = None  # decode takes the rotary delta only
        out: Outgoing = [("decode", Thaw(gen.rid))]
        form = self.forms.pop(gen.rid, None)
        firsts: list[tuple[SiblingStart, bool]] = []  # each choice's first token, and whether it ended there
        for rid, seed in [(gen.rid, job.seed), *((r, s) for r, s in job.siblings if r not in self.cut)]:
            req = Request(gen.prompt_ids, gen.sampling, seed, job.seq, rid=rid)
            self.processors.admit(req, form)  # (the same row for each, in turn; its grammar compiled)
            (first,), (logprobs,) = sample_with_logprobs(logits, [req], self.processors)
            finished = append_token(req, first, self.eos_ids, self.runner.max_context)
            listed = [] if logprobs is None else [logprobs]
            event = Tokens(rid, [first], req.finish_reason, prompt_tokens=n, logprobs=listed,
                           prompt_logprobs=job.prompt_logprobs)  # fmt: skip
            out.append(("router", event))
            firsts.append((SiblingStart(rid, first, seed), finished))
        self.cut.difference_update(rid for rid, _ in job.siblings)
        (own, finished), going = firsts[0], [start for start, ended in firsts[1:] if not ended]
        if finished and not going:
            return [*out, ("decode", ReleaseState(gen.rid)), *self._ask()]
        routing = b"" if self.tables is None else self.tables.statistics().cpu().numpy().tobytes()
        prompt = gen.prompt_ids if gen.sampling.repetition_penalty != 1.0 else []
        seq = job.seq
        done = PrefillDone(gen.rid, n, seq.num_cached, own.first_token, gen.sampling, job.seed, gen.arrival,
                           seq.slot, seq.pages, routing, seq.rope_delta, prompt, going, finished)  # fmt: skip
        return [*out, ("decode", done), *self._ask()]


def _seed(seed: int | None) -> int:
    """A request's sampling seed: its own, or one drawn for it."""
    return seed if seed is not None else random.getrandbits(62)
