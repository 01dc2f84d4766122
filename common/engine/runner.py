"""ModelRunner: steps a model over sequences whose state lives in a StatePool."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from common.engine.graphs import DecodeGraphs
from common.engine.model_api import CausalLM, as_causal_lm, as_mtp
from common.experts.kv_lending import KvLending
from common.kv.backend import AttentionBackend, TorchPagedBackend
from common.kv.batch import ForwardBatch
from common.kv.fp8 import parse_kv_dtype, scales_from_amax, with_kv_dtype
from common.kv.state import Allocator, LayerState, SequenceState, StatePool, StateSpec
from common.model.context import ForwardContext


def state_layout(
    model: nn.Module | CausalLM,
    max_running: int,
    max_context: int,
    page_size: int,
    kv_dtype: torch.dtype | str | None,
    dtype: torch.dtype | None = None,
) -> tuple[list[dict[str, StateSpec]], int]:
    """The state pool a runner of `model` makes: each layer's specs (state in `dtype`, default the model's
    first parameter's, as the runner takes it; K/V in `kv_dtype`) and the pages."""
    dtype = dtype or next(model.parameters()).dtype
    specs = with_kv_dtype(as_causal_lm(model).state_specs(dtype), parse_kv_dtype(kv_dtype))
    return specs, num_pages(max_running, max_context, page_size)


def num_pages(max_running: int, max_context: int, page_size: int) -> int:
    """KV pages of a state pool: every lane can hold a full context at once (the memory plan sizes the KV
    pool with this too, so the plan and the pool cannot disagree)."""
    return max_running * -(-max_context // page_size)


KV_CALIBRATION_TOKENS = 64
"""Synthetic tokens of the calibration pass that sets the fp8 K/V scales."""
KV_SCALE_MARGIN = 2.0
"""Headroom over the calibration amax: real text may reach further; beyond it values saturate at ±448."""


log = logging.getLogger(__name__)


class ModelRunner:
    """Owns the state pool of a model and runs forward passes that append tokens to sequences."""

    def __init__(
        self,
        model: nn.Module,
        max_running: int,
        max_context: int,
        page_size: int = 16,
        backend: AttentionBackend | None = None,
        kv_dtype: torch.dtype | str | None = None,
        allocate: Allocator | None = None,
        kv_scales: torch.Tensor | None = None,
        cuda_graphs: bool = False,
        kv_lending: KvLending | None = None,
    ) -> None:
        """`kv_dtype` (`fp8_e4m3`, a torch dtype, or None/`auto` for the model's) stores attention K/V only;
        other state stays in the model dtype. With fp8, `kv_scales` [layers, 2] (K, V) are the fixed
        per-layer scales (e.g. a checkpoint's k_scale/v_scale); None calibrates them at load (see
        `calibrate_kv_scales`). `allocate` makes the state pool's tensors (see StatePool).
        `cuda_graphs` (CUDA only) records decode passes and replays them (common/engine/graphs.py).
        `kv_lending`
        (built from `state_layout`'s specs and pages) holds the paged tensors, and starts lending them to the
        model's expert cache (common/experts/kv_lending.py)."""
        param = next(model.parameters())
        self.model, self.device = as_causal_lm(model), param.device
        self.module = model  # the same model, as common/model's functions take it
        self.backend = backend or TorchPagedBackend()
        specs, pages = state_layout(model, max_running, max_context, page_size, kv_dtype)
        paged = kv_lending.paged if kv_lending is not None else None
        self.pool = StatePool(specs, pages, page_size, max_running, self.device, allocate, paged)
        if kv_lending is not None:
            tables = getattr(self.model.experts, "tables", None)  # (an expert cache's)
            assert tables is not None, "KV pages are lent to an expert cache"
            kv_lending.bind(tables, self.pool)
        self.max_context, self.kv_dtype = max_context, kv_dtype
        if self.pool.kv_scales is not None:
            scales = kv_scales if kv_scales is not None else self.calibrate_kv_scales()
            self.pool.kv_scales.copy_(scales)
        self.graphs = None
        if cuda_graphs and self.device.type == "cuda":
            self.graphs = DecodeGraphs(model, self.pool, self.backend, max_context)

    def calibrate_kv_scales(self) -> torch.Tensor:
        """Per-layer K and V scales [layers, 2]: amax × KV_SCALE_MARGIN / 448 over one pass of seeded random
        tokens (MTP layers too), run with K/V in the model dtype.

        Fixed at load, so outputs do not depend on batch composition or arrival order (scales taken from
        live traffic would). Deterministic, so every process that calibrates the same model agrees; the
        prefill worker reads decode's scales anyway (they are exported with the pool).
        """
        n = KV_CALIBRATION_TOKENS
        probe = self._probe(2 * n)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(self.model.config.vocab_size, (n + 1,), generator=gen).tolist()
        untracked = getattr(self.model.experts, "untracked", contextlib.nullcontext)
        with _routing_hooks_off(self.model), untracked():  # no trace, no cache statistics of these tokens
            seq = probe.new_sequence()
            if getattr(self.model, "mtp", None) is not None:
                streams = probe.forward_streams([seq], [tokens[:n]])
                probe.draft([seq], [tokens[1:]], streams)  # MTP rows at positions n..2n-1
            else:
                probe.forward([seq], [tokens[:n]])
        return scales_from_amax(_kv_amax(probe.pool, self.device), KV_SCALE_MARGIN)

    def warm_up(self, tokens: int = 64) -> None:
        """Compile what requests will run before the first one comes: Triton and fla-core kernels compile
        and autotune on first use (tens of seconds on a fresh machine, which a first request's TTFT would
        pay). A throwaway sequence in a probe pool of its own (K/V as this pool's) takes a prefill of `tokens`
        tokens and one eager decode step, routing hooks off; an offloaded expert cache runs them untracked
        (frozen, its statistics and counters put back), so nothing of the warm-up stays."""
        scales = self.pool.kv_scales
        probe = self._probe(tokens + 1, self.kv_dtype, None if scales is None else scales.clone())
        untracked = getattr(self.model.experts, "untracked", contextlib.nullcontext)
        with _routing_hooks_off(self.model), untracked():
            seq = probe.new_sequence()
            first = probe.forward([seq], [list(range(3, 3 + tokens))]).argmax(-1)
            probe.forward([seq], [[int(first)]])
        del probe, seq
        if self.device.type == "cuda":  # the probe pool's blocks go back: they are not this runner's to keep
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def _probe(self, context: int, kv_dtype=None, kv_scales: torch.Tensor | None = None) -> ModelRunner:
        """A one-lane eager runner over this model with a pool of its own: passes that must not touch this
        runner's pool (calibration, warm-up)."""
        page_size = self.pool.page_size
        return ModelRunner(self.module, 1, context, page_size, self.backend, kv_dtype, kv_scales=kv_scales)

    def new_sequence(self) -> SequenceState:
        return self.pool.new_sequence()

    def release(self, seq: SequenceState) -> None:
        self.pool.release(seq)

    @torch.inference_mode()
    def forward(
        self, seqs: Sequence[SequenceState], tokens: Sequence[Sequence[int]], all_logits: bool = False
    ) -> torch.Tensor:
        """Append `tokens[b]` to `seqs[b]`; logits [B, V] of each last token, or [T, V] of every token.

        With CUDA graphs, a decode pass's logits are a recording's buffer: read them before the next pass.
        """
        batch = self._batch(seqs, tokens, prompt=True)  # a pass of several tokens here is a prompt's
        logits = self._pass(batch, all_logits)
        self._advance(seqs, tokens)
        return logits

    @torch.inference_mode()
    def forward_hidden(self, seq: SequenceState, tokens: Sequence[int]) -> torch.Tensor:
        """Append a prompt's `tokens` to `seq` (eager); the last layer's hidden states [T, H] of every token,
        whose logits `self.model.compute_logits` gives a slice at a time (a prompt's logprobs)."""
        batch = self._batch([seq], [tokens], prompt=True)
        hidden = self.model(self._context_of(batch))  # [T, H]
        self._advance([seq], [tokens])
        return hidden

    @torch.inference_mode()
    def decode(
        self, seqs: Sequence[SequenceState], newest: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode pass whose tokens are on the device already: sequence b's is newest[seqs[b].slot] (each
        lane's newest token, sampled by the pass before and not read by the host:
        common/engine/decode_pipeline.py)
        → logits [B, V], as `forward`'s, and the batch's slot ids [B] on the device."""
        tokens = [[0]] * len(seqs)  # one token a sequence: only the lengths are read
        batch = self._batch(seqs, tokens, prompt=False)
        batch.input_ids = newest[batch.slot_ids]
        logits = self._pass(batch, all_logits=False)
        self._advance(seqs, tokens)
        return logits, batch.slot_ids

    def _pass(self, batch: ForwardBatch, all_logits: bool) -> torch.Tensor:
        """A batch's forward: a decode pass through its recording (with CUDA graphs), anything else eager."""
        if self.graphs is not None and batch.is_decode and not all_logits:
            return self.graphs.run(batch, lambda: self._eager(batch, all_logits=False))
        return self._eager(batch, all_logits)

    @torch.inference_mode()
    def prefill_layer_major(
        self, seq: SequenceState, tokens: Sequence[int], chunk: int, kv_bound: int | None = None
    ) -> torch.Tensor:
        """Append a long prompt to `seq` in chunks of `chunk` tokens taken layer by layer: every chunk through
        layer l before any goes on to l + 1, so an offloaded model streams each layer's experts once for the
        whole prompt, where chunk-major passes stream them once a chunk; a layer's MoE runs once over all the
        chunks (common/model/layer_major.py). The same results (each chunk still sees the earlier ones' keys
        and states, in order); the chunks' residual streams are held at once.
        `kv_bound`: the prompt's whole length where these tokens are only its next piece (default: they end
        it; see `ForwardBatch.kv_bound`). → logits [1, V] of the last token."""
        bound = kv_bound if kv_bound is not None else seq.num_cached + len(tokens)
        self._reserve([seq], [tokens])
        contexts = []
        for at in range(0, len(tokens), chunk):
            piece = list(tokens[at : at + chunk])
            batch = ForwardBatch.build([seq], [piece], self.pool.page_size, self.device)
            batch.kv_bound = bound
            contexts.append(self._context_of(batch))
            seq.num_cached += len(piece)
        self.model.experts.begin_pass(False, prompt=True)
        hidden = self.model.forward_chunks(contexts)  # [T of the last chunk, H]
        return self.model.compute_logits(hidden[contexts[-1].batch.last_token_index()])

    def prefill_groups(
        self,
        seq: SequenceState,
        tokens: Sequence[int],
        chunk: int,
        group: int,
        between: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Append a long prompt to `seq` in groups of `group` tokens, each a layer-major pass over its chunks
        of `chunk` (`prefill_layer_major`: a group's streams are held at once, so the group bounds them);
        `between` runs between two groups (a running request's decode share) → logits [1, V] of the last
        token."""
        bound = seq.num_cached + len(tokens)
        for start in range(0, len(tokens), group):
            if start and between is not None:
                between()
            logits = self.prefill_layer_major(seq, tokens[start : start + group], chunk, bound)
        return logits

    def _eager(self, batch: ForwardBatch, all_logits: bool) -> torch.Tensor:
        hidden = self.model(self._context_of(batch))  # [T, H]
        return self.model.compute_logits(hidden if all_logits else hidden[batch.last_token_index()])

    @torch.inference_mode()
    def forward_streams(
        self, seqs: Sequence[SequenceState], tokens: Sequence[Sequence[int]], prompt: bool = False
    ) -> torch.Tensor:
        """Like forward, but return every token's pre-mixer streams [T, hc·H] (models with an MTP head);
        `prompt`: the tokens are a prompt's (not a verification of drafts)."""
        ctx = self._context(seqs, tokens, prompt)
        streams = as_mtp(self.model).forward_streams(ctx)
        self._advance(seqs, tokens)
        return streams

    @torch.inference_mode()
    def draft(
        self, seqs: Sequence[SequenceState], next_tokens: Sequence[Sequence[int]], streams: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP rows at positions seqs[b].num_cached...: (draft logits [T, V], MTP streams [T, hc·H]).

        Does not advance `seqs`: the caller decides which MTP rows are final.
        """
        return as_mtp(self.model).draft(streams, self._context(seqs, next_tokens))

    def _context(
        self, seqs: Sequence[SequenceState], tokens: Sequence[Sequence[int]], prompt: bool = False
    ) -> ForwardContext:
        return self._context_of(self._batch(seqs, tokens, prompt))

    def _context_of(self, batch: ForwardBatch) -> ForwardContext:
        """An eager pass's context: its batch, this runner's pool and attention backend, the backend's plan.
        An eager pass runs its lanes as one group (recorded passes may run two: common/engine/graphs.py)."""
        self.model.experts.regroup(1)
        return ForwardContext(batch, self.pool, self.backend, self.backend.plan(batch))

    def _batch(
        self, seqs: Sequence[SequenceState], tokens: Sequence[Sequence[int]], prompt: bool
    ) -> ForwardBatch:
        """Reserve the pages the tokens need, batch them, and tell the expert provider a pass begins (a
        prompt's: see `ExpertProvider.begin_pass`)."""
        self._reserve(seqs, tokens)
        batch = ForwardBatch.build(seqs, tokens, self.pool.page_size, self.device)
        self.model.experts.begin_pass(batch.is_decode, prompt)
        return batch

    def _reserve(self, seqs: Sequence[SequenceState], tokens: Sequence[Sequence[int]]) -> None:
        """The pages for `tokens[b]` appended to `seqs[b]`; ValueError past the context."""
        for seq, toks in zip(seqs, tokens, strict=True):
            total = seq.num_cached + len(toks)
            if total > self.max_context:
                raise ValueError(f"sequence of {total} tokens exceeds the context of {self.max_context}")
            self.pool.reserve(seq, total)

    @staticmethod
    def _advance(seqs: Sequence[SequenceState], tokens: Sequence[Sequence[int]]) -> None:
        for seq, toks in zip(seqs, tokens, strict=True):
            seq.num_cached += len(toks)


def warm_up_on_cuda(runner: ModelRunner) -> None:
    """A worker's warm-up before its first request (CUDA only): a failure costs only the first request's
    compile time, so it is logged, not raised."""
    if runner.device.type != "cuda":
        return
    try:
        runner.warm_up()
    except Exception:
        log.warning("warm-up failed; the first request compiles its kernels instead", exc_info=True)


@contextmanager
def _routing_hooks_off(model: CausalLM) -> Iterator[None]:
    """Detach every MoE block's routing hook (recorder, replayer) for the duration; put them back after."""
    hooked = {m: m.routing_hook for m in model.modules() if getattr(m, "routing_hook", None) is not None}
    for module in hooked:
        module.routing_hook = None  # type: ignore[assignment]  # torch types Module.__setattr__'s value as Tensor | Module: any goes
    try:
        yield
    finally:
        for module, hook in hooked.items():
            module.routing_hook = hook


def _kv_amax(pool: StatePool, device: torch.device) -> torch.Tensor:
    """[layers, 2] largest |K| and |V| in each layer's pages (0 for layers without K/V)."""
    zero = torch.zeros((), device=device)

    def amax(layer: LayerState, name: str) -> torch.Tensor:
        return layer.paged[name].abs().amax().float() if name in layer.paged else zero

    return torch.stack([torch.stack([amax(layer, "k"), amax(layer, "v")]) for layer in pool.layers])
