"""Offline generation: load a model directory and generate for a batch of prompts in one process."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from common.config import LAYER_MAJOR_TOKENS, PREFILL_CHUNK, check_lending, resolve_lookahead
from common.engine.runner import ModelRunner, state_layout
from common.engine.speculative import MTPSpeculator
from common.experts.artifact import is_artifact, open_store
from common.experts.cache_tables import DEFAULT_POLICY
from common.experts.offload import offload_experts
from common.experts.routing import RoutingRecorder, install_routing_hook, replayer_for
from common.kernels import fused_by_default
from common.kernels.config import KERNELS, KernelConfig
from common.kv.lending import KvLending
from common.kv.state import Allocator, PromptImages, SequenceState
from common.model.fp8_linear import to_resident_dtype
from common.model.fused_kernels import configure_kernels, use_fused_kernels
from common.model.host_embedding import embeddings_to_host
from common.model.loader import load_model
from common.model.moe import install_lookahead
from common.sampling.logit_processors import LogitProcessors
from common.sampling.requests import Request, append_token, sample_next
from common.sampling.sampler import SamplingParams
from common.text.tokenizer import Tokenizer


@dataclass
class GenerationResult:
    """What generate() returns per prompt."""

    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    """`stop` (an end-of-sequence or stop token) or `length` (max_tokens reached)."""


class Engine:
    """A model, its tokenizer and a runner; generates with continuous batching over `max_seqs` lanes."""

    def __init__(
        self,
        model_dir: str | Path,
        dtype: torch.dtype = torch.bfloat16,
        device: str = "cpu",
        max_seqs: int = 8,
        max_context: int | None = None,
        speculative: str | None = None,
        num_draft: int = 2,
        expert_cache: str | None = None,
        cache_policy: str = DEFAULT_POLICY,
        expert_format: str = "bf16",
        prefill_chunk: int = PREFILL_CHUNK,
        layer_major_tokens: int = LAYER_MAJOR_TOKENS,
        record_routing: bool = False,
        replay_routing: str | None = None,
        pinned_experts: dict[int, list[int]] | None = None,
        page_size: int = 16,
        kv_dtype: str | None = None,
        allocate: Allocator | None = None,
        host_allocate: Callable[[int], torch.Tensor] | None = None,
        arena_buffers: int = 2,
        cuda_graphs: bool = True,
        embeddings_on_host: bool = False,
        fused_kernels: bool | None = None,
        lend_arena: bool = False,
        resident_dtype: str | None = None,
        lend_kv: bool = False,
        prefill_bank: bool = False,
        lookahead: int | None = None,
        kernels: KernelConfig = KERNELS,
    ) -> None:
        """`expert_cache` (SLOTS | FRACTION | all) serves the routed experts from host memory through a VRAM
        cache (None: all resident); `prefill_chunk` bounds the tokens of one prefill pass,
        `layer_major_tokens` those of one sequence's prompt taken layer by layer (see LAYER_MAJOR_TOKENS);
        `record_routing` keeps the router's choices (`routing_recorder.trace()`); `replay_routing` (a trace
        file or `synthetic-zipf:...`) forces them; `pinned_experts` (MoE layer index → experts, a calibration
        hot set) stay cached for good; `kv_dtype` (`fp8_e4m3`; None or `auto`: the model dtype) stores
        attention K/V in fp8 with fixed per-layer scales (see ModelRunner); `allocate` makes the state pool's
        tensors (see StatePool), `host_allocate` the host expert store's memory (see HostExpertStore);
        `arena_buffers` 1 drops the prefill arena's second buffer (no copy/compute overlap) for a worker that
        never prefills; `cuda_graphs` records and replays decode passes on CUDA (see ModelRunner);
        `embeddings_on_host` keeps the token embedding in host memory (common/model/host_embedding.py);
        `fused_kernels` switches the fused Triton kernels and projections on or off
        (`use_fused_kernels`; None: on CUDA); `lend_arena` gives the prefill arena's second
        buffer to the expert cache between prefills (E more slots during decode; see OffloadedExperts; each
        prefill pass takes it back, emptied); `resident_dtype` "fp8" keeps the token mixers' projections in
        fp8 (common/model/fp8_linear.py; None: the model dtype); `lend_kv` lends the KV pool's idle pages
        to the expert cache as slots, taken back as contexts grow (common/kv/lending.py); `prefill_bank` (a
        serving decode worker's) adds a bank of 1 + 2E slots that a prefill worker uses as its arena, lent to
        the cache between prefills by the worker (`DecodeCore`); `lookahead` (with an expert cache): each MoE
        layer guesses the next one's top-n experts a token and copies them in ahead (`install_lookahead`;
        0: off; None: `resolve_lookahead`'s default); `kernels`: the kernel forms and launch options
        (common/kernels/config.py)."""
        if speculative not in (None, "mtp"):
            raise ValueError(f"speculative must be None or 'mtp', not {speculative!r}")
        if speculative and lend_arena:  # its verify passes read the arena: the cache would lose it each step
            raise ValueError("lending the arena does not combine with speculative decoding")
        check_lending(str(model_dir), expert_cache is not None, lend_kv, lend_arena, prefill_bank)
        lookahead = resolve_lookahead(str(model_dir), expert_cache is not None, lookahead, str(device))
        offloaded = expert_cache is not None  # its experts go to a host store: read them to the host
        fused_kernels = fused_by_default(fused_kernels, device)
        self.model = load_model(
            model_dir, dtype=dtype, device=device, with_mtp=speculative == "mtp",
            expert_device="cpu" if offloaded else None, fuse=fused_kernels,
        )  # fmt: skip
        if embeddings_on_host:  # before the expert cache takes the device memory it frees
            embeddings_to_host(self.model)
        if resident_dtype is not None:
            to_resident_dtype(self.model, resident_dtype)
        self.config = self.model.config
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.max_seqs = max_seqs
        context = min(self.config.max_position, max_context or 4096)
        lending = None
        if lend_kv:
            specs, pages = state_layout(self.model, max_seqs, context, page_size, kv_dtype)
            lending = KvLending(specs, pages, page_size, device)
        self.kv_lending = lending
        if is_artifact(model_dir):  # experts packed once by `spillway convert`: map them, serve them cached
            store, meta = open_store(model_dir)
            self.offload = offload_experts(
                self.model, expert_cache or "all", cache_policy, meta["format"], pinned_experts, store,
                arena_buffers=arena_buffers, lend_arena=lend_arena, kv_lending=lending,
                prefill_bank=prefill_bank,
            )  # fmt: skip
        elif expert_cache is not None:
            self.offload = offload_experts(
                self.model, expert_cache, cache_policy, expert_format, pinned_experts, None, host_allocate,
                arena_buffers, lend_arena, lending, prefill_bank,
            )  # fmt: skip
        cfg, layers = self.config, list(self.config.moe_layers)
        install_lookahead(self.model, lookahead, cfg.num_layers)
        self.routing_recorder = RoutingRecorder(layers, cfg.num_experts) if record_routing else None
        if replay_routing is not None:
            install_routing_hook(self.model, replayer_for(replay_routing, layers, cfg.num_experts, cfg.top_k))
        elif self.routing_recorder is not None:
            install_routing_hook(self.model, self.routing_recorder)
        self.prefill_chunk = prefill_chunk
        self.layer_major_tokens = layer_major_tokens
        self.runner = ModelRunner(
            self.model,
            max_seqs=max_seqs,
            max_context=context,
            page_size=page_size,
            kv_dtype=kv_dtype,
            allocate=allocate,
            cuda_graphs=cuda_graphs,
            kv_lending=lending,
        )
        self.device = self.runner.device
        self.speculator = MTPSpeculator(self.runner, num_draft) if speculative else None
        self.processors = LogitProcessors.for_runner(self.runner, self.config.eos_token_ids, self.tokenizer)
        if fused_kernels:  # before the first decode pass is recorded (the projections were fused at load)
            use_fused_kernels(self.model, True, self.runner.backend)
        self.kernels = kernels
        configure_kernels(self.model, kernels, self.runner.backend)  # after the fusion: its projections too

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        images: Sequence[tuple[PromptImages, int] | None] | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt; at most `max_seqs` run at once, the rest wait for a free lane.
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
            admitted = {}
            while waiting and len(running) + len(admitted) < self.max_seqs:
                index, prompt, p = waiting.pop(0)
                seed = p.seed if p.seed is not None else random.getrandbits(62)
                admitted[index] = Request(list(prompt), p, seed, self.runner.new_sequence())
                self.processors.admit(admitted[index])
                if images[index] is not None:
                    admitted[index].state.images, admitted[index].state.rope_delta = images[index]
            if admitted:  # the running lanes take a decode step between its passes (a decode share)
                between = (lambda: self._decode_unfinished(running)) if running else None
                self._prefill(list(admitted.values()), between)
                running.update(admitted)
            else:
                self._decode(list(running.values()))
            for index in [i for i, r in running.items() if r.finish_reason]:
                req = running.pop(index)
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
        """Last-token logits [B, V], in passes of at most `prefill_chunk` tokens of each sequence (one
        sequence: groups of `layer_major_tokens`, each a layer-major pass over its chunks); `between` runs
        between two passes."""
        if max(len(t) for t in tokens) <= self.prefill_chunk:
            return self.runner.forward(seqs, tokens)
        if len(seqs) == 1 and self.layer_major_tokens > self.prefill_chunk:
            chunk, group = self.prefill_chunk, self.layer_major_tokens
            return self.runner.prefill_groups(seqs[0], tokens[0], chunk, group, between)
        last: dict[int, torch.Tensor] = {}
        for start in range(0, max(len(t) for t in tokens), self.prefill_chunk):
            if start and between is not None:
                between()
            live = [b for b, t in enumerate(tokens) if start < len(t)]
            chunk = [tokens[b][start : start + self.prefill_chunk] for b in live]
            logits = self.runner.forward([seqs[b] for b in live], chunk)
            for row, b in enumerate(live):
                last[b] = logits[row]
        return torch.stack([last[b] for b in range(len(tokens))])

    def _emit(self, reqs: list[Request], new_tokens: list[list[int]]) -> None:
        """Append each request's new tokens up to the first that finishes it."""
        for req, tokens in zip(reqs, new_tokens, strict=True):
            for token in tokens:
                if append_token(req, token, self.config.eos_token_ids, self.runner.max_context):
                    break


def _processed(params: SamplingParams) -> bool:
    """Whether a request's logits go through common/sampling/logit_processors.py (which MTP's drafts do
    not)."""
    return params.penalized or bool(params.logit_bias or params.structure) or params.min_tokens > 0
