"""Offline generation: load a model directory and generate for a batch of prompts in one process."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from common.config import ModelConfig, WorkerConfig, check_lending, resolve_lookahead
from common.engine.memory_plan import DTYPES, weight_bytes
from common.engine.runner import ModelRunner, state_layout
from common.engine.speculative import MTPSpeculator
from common.experts.artifact import is_artifact, open_store
from common.experts.kv_lending import KvLending
from common.experts.offload import OffloadedExperts, load_hot_set, offload_experts
from common.experts.routing import RoutingRecorder, install_routing_hook, replayer_for
from common.kernels import fused_by_default
from common.kv.state import Allocator, PromptImages, SequenceState
from common.model.fp8_linear import to_resident_dtype
from common.model.fused_kernels import configure_kernels, use_fused_kernels
from common.model.host_embedding import embeddings_to_host
from common.model.loader import load_model
from common.model.moe import install_lookahead
from common.model.resident import ResidentExperts
from common.protocol import SamplingParams
from common.sampling.logit_processors import LogitProcessors
from common.sampling.requests import Request, append_token, sample_next
from common.text.tokenizer import Tokenizer


@dataclass
class GenerationResult:
    """What generate() returns per prompt."""

    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    """`stop` (an end-of-sequence or stop token) or `length` (max_tokens reached)."""


class Engine:
    """A model, its tokenizer and a runner, as a `WorkerConfig` describes them; generates with continuous
    batching over `cfg.max_running` lanes."""

    def __init__(
        self,
        cfg: WorkerConfig,
        *,
        decode_worker: bool = False,
        allocate: Allocator | None = None,
        host_allocate: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        """Every setting is `cfg`'s (its fields' docstrings); `cfg.vram_budget` is the caller's to apply
        (`apply_memory_plan` sizes `expert_cache` with it). `decode_worker`: the engine is serve's decode
        worker, whose prompts the prefill worker prefills into its pools: its arena keeps one buffer (the
        staging rows; the other goes to the cache), and `cfg.lend_arena` holds the prefill worker's arena in
        its expert pool as the cache's bank (else it lends the engine's own second buffer between prefills).
        `allocate` makes the state pool's tensors (see StatePool), `host_allocate` the host expert store's
        memory (see HostExpertStore): shared memory the prefill worker maps."""
        if cfg.speculative not in (None, "mtp"):
            raise ValueError(f"speculative must be None or 'mtp', not {cfg.speculative!r}")
        own_arena, bank = cfg.lend_arena and not decode_worker, cfg.lend_arena and decode_worker
        if cfg.speculative and own_arena:  # verify passes read the arena: the cache would lose it each step
            raise ValueError("lending the arena does not combine with speculative decoding")
        cached = cfg.expert_cache is not None
        check_lending(cfg.model_dir, cached, cfg.lend_kv, cfg.lend_arena, decode_worker=decode_worker)
        lookahead = resolve_lookahead(cfg.model_dir, cached, cfg.lookahead, cfg.device)
        fused = fused_by_default(cfg.fused_kernels, cfg.device)
        pinned = load_hot_set(cfg.pin_experts) if cfg.pin_experts else None
        self.cfg = cfg
        self.model = _load(cfg, fused)
        config = self.model.config
        assert isinstance(config, ModelConfig)
        self.config: ModelConfig = config
        self.tokenizer = Tokenizer.from_dir(cfg.model_dir)
        context = min(config.max_position, cfg.max_context)
        self.kv_lending: KvLending | None = None
        if cfg.lend_kv:
            specs, pages = state_layout(self.model, cfg.max_running, context, cfg.page_size, cfg.kv_dtype)
            self.kv_lending = KvLending(specs, pages, cfg.page_size, cfg.device)
        self.offload: OffloadedExperts | None = None
        if cached or is_artifact(cfg.model_dir):
            arenas = 1 if decode_worker else 2
            lent = (own_arena, bank, self.kv_lending)
            self.offload = _offload(self.model, cfg, pinned, arenas, lent, host_allocate)
        install_lookahead(self.model, lookahead, config.num_layers)
        self.routing_recorder = _route(self.model, cfg, config)
        self.runner = ModelRunner(
            self.model,
            max_running=cfg.max_running,
            max_context=context,
            page_size=cfg.page_size,
            kv_dtype=cfg.kv_dtype,
            allocate=allocate,
            cuda_graphs=cfg.cuda_graphs,
            kv_lending=self.kv_lending,
        )
        self.device = self.runner.device
        self.speculator = MTPSpeculator(self.runner, cfg.num_draft) if cfg.speculative else None
        self.processors = LogitProcessors.for_runner(self.runner, config.eos_token_ids, self.tokenizer)
        if fused:  # before the first decode pass is recorded (the projections were fused at load)
            use_fused_kernels(self.model, True, self.runner.backend)
        self.kernels = cfg.kernels
        configure_kernels(self.model, cfg.kernels, self.runner.backend)  # after the fusion: its projections

    def pool_bytes(self) -> dict[str, int]:
        """Bytes this engine holds on its device by pool, measured (the `spillway:vram_bytes` labels a memory
        plan fills): resident weights, the state pool (`kv`), and offloaded, the cache's slots
        (`expert_cache`) and the other expert rows (`arena`: the spare row and the arena buffers)."""
        pools = {"weights": weight_bytes(self.model)}
        pools["kv"] = sum(t.nbytes for t in self.runner.pool.named_tensors().values())
        experts = getattr(self.model, "experts", None)
        if isinstance(experts, ResidentExperts):  # the routed experts, held on the device too
            pools["weights"] += sum(w.gate_up.nbytes + w.down.nbytes for w in experts.weights.values())
        if self.offload is not None:
            rows = sum(t.nbytes for t in self.offload.pool.values())
            cache = self.offload.tables.num_slots * self.offload.store.expert_bytes
            pools["expert_cache"], pools["arena"] = cache, max(rows - cache, 0)
        return pools

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        images: Sequence[tuple[PromptImages, int] | None] | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt; at most `cfg.max_running` run at once, the rest wait for a free lane.
        `images[i]`: prompt i's images and rotary delta (`common.model.qwen4_exp.positions.prompt_images`)."""
        all_params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if self.speculator is not None and any(p.temperature > 0 or _processed(p) for p in all_params):
            raise ValueError(
                "speculative decoding serves greedy requests (temperature 0) only, without penalties, "
                "logit biases, min_tokens or structured output"
            )
        images = list(images) if images is not None else [None] * len(prompts)
        if self.speculator is not None and any(images):
            raise ValueError("speculative decoding takes prompts without images")
        waiting = list(zip(range(len(prompts)), prompts, all_params, strict=True))
        results: dict[int, GenerationResult] = {}
        running: dict[int, Request] = {}
        while waiting or running:
            admitted: dict[int, Request] = {}
            while waiting and len(running) + len(admitted) < self.cfg.max_running:
                index, prompt, p = waiting.pop(0)
                seed = p.seed if p.seed is not None else random.getrandbits(62)
                req = admitted[index] = Request(list(prompt), p, seed, self.runner.new_sequence())
                self.processors.admit(req)
                image = images[index]
                if image is not None:
                    req.state.images, req.state.rope_delta = image
            if admitted:  # the running lanes take a decode step between its passes (a decode share)
                between = (lambda: self._decode_unfinished(running)) if running else None
                self._prefill(list(admitted.values()), between)
                running.update(admitted)
            else:
                self._decode(list(running.values()))
            for index in [i for i, r in running.items() if r.finish_reason]:
                req = running.pop(index)
                assert req.finish_reason is not None
                if self.speculator is not None:
                    self.speculator.release(req.state)
                self.runner.release(req.state)
                results[index] = GenerationResult(req.prompt_ids, req.token_ids, req.finish_reason)
        return [results[i] for i in range(len(prompts))]

    def _prefill(self, reqs: list[Request], between: Callable[[], None] | None = None) -> None:
        """Prefill `reqs` and sample their first tokens; `between` runs between two chunk passes. A prompt
        with images is prefilled alone (its passes carry its images' positions and embeddings)."""
        if self.speculator is not None:
            first = self.speculator.prefill([r.state for r in reqs], [r.prompt_ids for r in reqs])
            self._emit(reqs, [[t] for t in first])
            return
        groups = (
            [r for r in reqs if r.state.images is None],
            *([r] for r in reqs if r.state.images is not None),
        )
        for group in filter(None, groups):
            self._sample_step(group, [r.prompt_ids for r in group], between)
            for req in group:
                req.state.images = None  # decode takes the rotary delta only

    def _decode_unfinished(self, running: dict[int, Request]) -> None:
        """A decode step of the running requests that have not finished (a long prefill's decode share)."""
        reqs = [r for r in running.values() if not r.finish_reason]
        if reqs:
            self._decode(reqs)

    def _decode(self, reqs: list[Request]) -> None:
        if self.speculator is not None:
            self._emit(reqs, self.speculator.step([r.state for r in reqs], [r.token_ids[-1] for r in reqs]))
        else:
            self._sample_step(reqs, [[r.token_ids[-1]] for r in reqs])

    def _sample_step(
        self, reqs: list[Request], tokens: list[list[int]], between: Callable[[], None] | None = None
    ) -> None:
        logits = self._forward_chunked([r.state for r in reqs], tokens, between)  # [B, V]
        self._emit(reqs, [[t] for t in sample_next(logits, reqs, self.processors)])

    def _forward_chunked(
        self,
        seqs: list[SequenceState],
        tokens: list[list[int]],
        between: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Last-token logits [B, V], in passes of at most `cfg.prefill_chunk` tokens of each sequence (one
        sequence: groups of `cfg.layer_major_tokens`, each a layer-major pass over its chunks); `between` runs
        between two passes."""
        if max(len(t) for t in tokens) <= self.cfg.prefill_chunk:
            return self.runner.forward(seqs, tokens)
        if len(seqs) == 1 and self.cfg.layer_major_tokens > self.cfg.prefill_chunk:
            chunk, group = self.cfg.prefill_chunk, self.cfg.layer_major_tokens
            return self.runner.prefill_groups(seqs[0], tokens[0], chunk, group, between)
        last: dict[int, torch.Tensor] = {}
        for start in range(0, max(len(t) for t in tokens), self.cfg.prefill_chunk):
            if start and between is not None:
                between()
            live = [b for b, t in enumerate(tokens) if start < len(t)]
            pieces = [tokens[b][start : start + self.cfg.prefill_chunk] for b in live]
            logits = self.runner.forward([seqs[b] for b in live], pieces)
            for row, b in enumerate(live):
                last[b] = logits[row]
        return torch.stack([last[b] for b in range(len(tokens))])

    def _emit(self, reqs: list[Request], new_tokens: list[list[int]]) -> None:
        """Append each request's new tokens up to the first that finishes it."""
        for req, tokens in zip(reqs, new_tokens, strict=True):
            for token in tokens:
                if append_token(req, token, self.config.eos_token_ids, self.runner.max_context):
                    break


def _load(cfg: WorkerConfig, fused: bool) -> torch.nn.Module:
    """The model of `cfg`, its embedding and resident projections placed as `cfg` says (before an expert
    cache takes the device memory they free); an offloaded model's experts are read to the host."""
    model = load_model(
        cfg.model_dir, dtype=DTYPES[cfg.model_dtype], device=cfg.device, with_mtp=cfg.speculative == "mtp",
        expert_device="cpu" if cfg.expert_cache is not None else None, fuse=fused,
        published_only=cfg.expert_cache is not None,
    )  # fmt: skip
    if cfg.embeddings_on_host:
        embeddings_to_host(model)
    if cfg.resident_dtype is not None:
        to_resident_dtype(model, cfg.resident_dtype)
    return model


def _offload(
    model: torch.nn.Module,
    cfg: WorkerConfig,
    pinned: dict[int, list[int]] | None,
    arena_buffers: int,
    lent: tuple[bool, bool, KvLending | None],
    host_allocate: Callable[[int], torch.Tensor] | None,
) -> OffloadedExperts:
    """`model`'s routed experts served through the expert cache `cfg` asks for: an artifact's mapped store
    (`spillway convert`; all cached when `cfg` names no cache), or a store packed now in `host_allocate`'s
    memory. `lent`: the engine's own arena, a prefill worker's arena (the bank) and KV pages as slots."""
    own_arena, bank, kv_lending = lent
    if is_artifact(cfg.model_dir):
        store, meta = open_store(cfg.model_dir)
        return offload_experts(
            model, cfg.expert_cache or "all", cfg.cache_policy, meta["format"], pinned, store,
            arena_buffers=arena_buffers, lend_arena=own_arena, kv_lending=kv_lending, prefill_bank=bank,
        )  # fmt: skip
    assert cfg.expert_cache is not None
    return offload_experts(
        model, cfg.expert_cache, cfg.cache_policy, cfg.expert_format, pinned, None, host_allocate,
        arena_buffers, own_arena, kv_lending, bank,
    )  # fmt: skip


def _route(model: torch.nn.Module, cfg: WorkerConfig, config: ModelConfig) -> RoutingRecorder | None:
    """Install `cfg`'s routing hook: the replayed choices of `replay_routing`, or a recorder of the router's
    own (returned) with `record_routing`."""
    layers = list(config.moe_layers)
    recorder = RoutingRecorder(layers, config.num_experts) if cfg.record_routing else None
    if cfg.replay_routing is not None:
        replayer = replayer_for(cfg.replay_routing, layers, config.num_experts, config.top_k)
        install_routing_hook(model, replayer)
    elif recorder is not None:
        install_routing_hook(model, recorder)
    return recorder


def _processed(params: SamplingParams) -> bool:
    """Whether a request's logits go through common/sampling/logit_processors.py (which MTP's drafts do
    not)."""
    return params.penalized or bool(params.logit_bias or params.structure) or params.min_tokens > 0
