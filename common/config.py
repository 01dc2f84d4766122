"""Frozen configuration dataclasses shared by every part of Spillway.

Config flows through the code as these objects, never as loose dicts. Parsing from a Hugging Face
`config.json` lives next to each architecture in `common/model/`; this module only defines the shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.kernels.config import KERNELS, KernelConfig
from common.kernels.config import MOE_DOWN_TOKENS as MOE_DOWN_TOKENS  # re-exported: the memory plan's


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding parameters (HF `rope_theta` + `rope_scaling` / `rope_parameters`)."""

    theta: float
    """Base wavelength of the rotary frequencies."""
    rope_type: str = "default"
    """One of `default`, `linear`, `yarn`, `llama3`."""
    factor: float = 1.0
    """Context extension factor (linear, yarn, llama3)."""
    original_max_position: int | None = None
    """Pre-training context length that scaling extends from (yarn, llama3)."""
    attention_factor: float | None = None
    """Scale applied to cos/sin (yarn); derived from `factor`/`mscale` when None."""
    beta_fast: float = 32.0
    """Yarn: rotations above which a dimension is extrapolated."""
    beta_slow: float = 1.0
    """Yarn: rotations below which a dimension is interpolated."""
    mscale: float | None = None
    """Yarn (DeepSeek form): numerator of the attention-factor ratio."""
    mscale_all_dim: float | None = None
    """Yarn (DeepSeek form): denominator of the attention-factor ratio."""
    truncate: bool = True
    """Yarn: round the correction range to whole dimensions."""
    low_freq_factor: float = 1.0
    """Llama3: wavelength boundary factor for low frequencies."""
    high_freq_factor: float = 4.0
    """Llama3: wavelength boundary factor for high frequencies."""
    partial_rotary_factor: float = 1.0
    """Fraction of head_dim that is rotated (the rest passes through)."""
    mrope_section: tuple[int, ...] = ()
    """Multimodal RoPE (qwen4_exp, interleaved): frequencies per axis (temporal, height, width); frequency
    i takes the height's position where i % 3 == 1 and i < 3 · section[1], the width's where i % 3 == 2 and
    i < 3 · section[2], the temporal one elsewhere. Empty: one position a token. Text positions are equal on
    the three axes, so the sections change nothing until a prompt has images."""


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only MoE language model, normalised across HF families."""

    model_type: str
    """HF `model_type` (`qwen3_moe`, `qwen2_moe`, `mixtral`, ...): selects the architecture."""
    vocab_size: int
    """Rows of the embedding table and of lm_head."""
    hidden_size: int
    """Width of the residual stream."""
    num_layers: int
    """Number of decoder layers."""
    num_heads: int
    """Query heads per attention layer."""
    num_kv_heads: int
    """Key/value heads per attention layer (GQA when fewer than num_heads)."""
    head_dim: int
    """Width of one attention head (may differ from hidden_size / num_heads)."""
    rms_norm_eps: float
    """Epsilon of every RMSNorm."""
    max_position: int
    """Longest context the model supports (HF `max_position_embeddings`)."""
    rope: RopeConfig
    """Rotary embedding parameters."""
    layer_types: tuple[str, ...]
    """Token mixer of each layer: `full_attention` or `sliding_attention` (later: `linear_attention`)."""
    mlp_types: tuple[str, ...]
    """Channel mixer of each layer: `moe` (routed experts) or `dense` (a SwiGLU MLP)."""
    intermediate_size: int
    """Width of the dense MLP of `dense` layers."""
    num_experts: int
    """Routed experts per MoE layer."""
    top_k: int
    """Experts chosen per token."""
    moe_intermediate_size: int
    """Width of one routed expert's MLP."""
    norm_topk_prob: bool
    """Renormalise the top-k routing probabilities to sum to one."""
    shared_expert_intermediate_size: int = 0
    """Width of the shared expert (0: no shared expert)."""
    shared_expert_gated: bool = False
    """The shared expert's output is scaled by sigmoid(shared_expert_gate(x))."""
    router_weights_fp32: bool = False
    """Routing weights stay fp32 when applied (Mixtral); otherwise cast to the activation dtype (Qwen)."""
    qkv_bias: bool = False
    """q/k/v projections have a bias."""
    o_bias: bool = False
    """The output projection has a bias."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys before RoPE (Qwen3)."""
    sliding_window: int | None = None
    """Window of `sliding_attention` layers, in tokens (a query sees this many keys, itself included)."""
    hidden_act: str = "silu"
    """Activation of the gated MLPs."""
    tie_word_embeddings: bool = False
    """lm_head shares the embedding matrix."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token, if the family uses one."""
    eos_token_ids: tuple[int, ...] = ()
    """Tokens that end generation (config.json, extended by generation_config.json)."""
    torch_dtype: str = "bfloat16"
    """Storage dtype of the checkpoint."""
    router: str = "softmax"
    """How the router scores experts: "softmax" (top-k of the softmax), or "sigmoid-grouped" (GLM-4.5,
    DeepSeek-V3: sigmoid scores, a per-expert correction bias for the choice only, the top `topk_group` of
    `n_group` groups by their two best, weights the chosen sigmoids times `routed_scaling_factor`)."""
    n_group: int = 1
    """Expert groups of the sigmoid-grouped router."""
    topk_group: int = 1
    """Groups a token may choose from."""
    routed_scaling_factor: float = 1.0
    """Factor on the sigmoid-grouped router's weights (after any renormalisation)."""

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the layers whose channel mixer is the routed-expert block."""
        return tuple(i for i, t in enumerate(self.mlp_types) if t == "moe")


PREFILL_CHUNK = 8192
"""Most prompt tokens of one prefill pass, by default (its activations are the prefill scratch)."""

LAYER_MAJOR_TOKENS = 32768
"""Most prompt tokens of one sequence prefilled layer by layer, by default: its chunks all go through a layer
before any goes on (`ModelRunner.prefill_layer_major`), so an offloaded model streams each layer's experts
once per this many tokens instead of once per chunk (prefill-25k on the H200: 12.7 s in four chunk-major
passes, 6.2 s layer-major), and its MoE runs once over all of them (common/model/layer_major.py). The chunks'
residual streams are held meanwhile: hc·H model-dtype values a token (flashnext: 0.5 GB for 32K tokens), and
the MoE's buffers are a group's (~0.8 GB more at 32K), both counted by the memory plan."""


GRAMMAR_MAX_BYTES = 512 * 1024
"""Largest structured-output form (`SamplingParams.structure`, its JSON text) served by default: a form's
compile grows faster than its size (a long enum's, worst), and this bounds the grammar the router builds to
check a schema, on its event loop."""

GRAMMAR_TIMEOUT_S = 20.0
"""Seconds a request waits for its grammar's compile by default before it fails (a 400)."""


ARTIFACT_META = "experts.json"
"""The metadata file of an artifact (`spillway convert`'s output: experts packed once) in its directory."""


def is_artifact(model_dir: str | Path) -> bool:
    """Whether `model_dir` holds an artifact (its ARTIFACT_META file) rather than a checkpoint."""
    return (Path(model_dir) / ARTIFACT_META).is_file()


def check_lending(
    model_dir: str, cached: bool, lend_kv: bool, lend_arena: bool, *, decode_worker: bool
) -> None:
    """ValueError unless the lending asked for can hold: KV pages (`lend_kv`) and prefill's arena
    (`lend_arena`: in serve's decode worker, `decode_worker`, the prefill worker's; in the offline engine, its
    own) each lend the cache tables' one bank, so at most one of them; KV pages and the prefill worker's
    arena need an expert cache (`cached`, or an artifact's)."""
    arena = "--lend-arena" if decode_worker else "the engine's own arena"
    lenders = [name for name, on in (("--lend-kv", lend_kv), (arena, lend_arena)) if on]
    if len(lenders) > 1:
        raise ValueError(f"{' and '.join(lenders)} lend the same bank of the cache: give one of them")
    if (lend_kv or (lend_arena and decode_worker)) and not cached and not is_artifact(model_dir):
        raise ValueError(f"{lenders[0]} needs an expert cache: give --expert-cache or --vram-budget")


DEFAULT_LOOKAHEAD = 4
"""Experts a token each MoE layer guesses for the next by default, on CUDA with an expert cache (a layer
keeps copying its guesses in only while they are used: `OffloadedExperts.guess_precision`; bench/LOG.md,
Lookahead)."""


def resolve_lookahead(model_dir: str, cached: bool, lookahead: int | None, device: str) -> int:
    """The experts a token each MoE layer guesses for the next: `lookahead`, or with None the default
    (DEFAULT_LOOKAHEAD with an expert cache — `cached`, or an artifact's — on CUDA, where the guesses run
    beside the compute; else 0). ValueError unless a given value can hold: not negative, and a guess needs
    an expert cache to copy into."""
    has_cache = cached or is_artifact(model_dir)
    if lookahead is None:
        return DEFAULT_LOOKAHEAD if has_cache and device.startswith("cuda") else 0
    if lookahead < 0:
        raise ValueError(f"--lookahead counts experts a token: {lookahead} is below 0")
    if lookahead and not has_cache:
        raise ValueError("--lookahead guesses which experts to copy in: give --expert-cache or --vram-budget")
    return lookahead


@dataclass(frozen=True)
class WorkerConfig:
    """How the prefill and decode workers load and run the model (both read the same one)."""

    model_dir: str
    """Hugging Face model directory or `spillway convert` artifact."""
    device: str = "cpu"
    """`cpu`, `cuda` or `cuda:N`: where decode allocates everything and prefill runs."""
    dtype: str = "float32"
    """Activation and resident-weight dtype: `float32`, `bfloat16`, `float16`, or `auto` (bfloat16 on CUDA,
    float32 on the CPU: `model_dtype`)."""
    max_running: int = 8
    """Decode lanes: requests decoded together; also the state pool's slots."""
    max_context: int = 4096
    """Most tokens (prompt + generated) of one request; sizes the KV pool with `max_running`."""
    expert_cache: str | None = None
    """`SLOTS`, `FRACTION` or `all`: serve routed experts from host memory through a VRAM cache
    (None: all resident, unless the model is an artifact)."""
    cache_policy: str = "lfu-admit"
    """Expert cache policy: `lru`, `lfu` or `lfu-admit`."""
    expert_format: str = "bf16"
    """Runtime format of offloaded experts: `bf16`, `fp8` or `int4`."""
    prefill_chunk: int = PREFILL_CHUNK
    """Most prompt tokens of one prefill pass."""
    layer_major_tokens: int = LAYER_MAJOR_TOKENS
    """Most prompt tokens prefilled layer by layer at once (see LAYER_MAJOR_TOKENS; ≤ `prefill_chunk`: chunk
    by chunk); an abort waits at most this many tokens."""
    replay_routing: str | None = None
    """Force the router's choices: a trace file or `synthetic-zipf:...` (benchmarks)."""
    page_size: int = 16
    """Tokens per KV page."""
    kv_dtype: str | None = None
    """Attention K/V storage: None or `auto` (the model dtype) or `fp8_e4m3` (half of bf16's bytes, fixed
    per-layer K and V scales calibrated at load; indexer keys and recurrent state stay in `dtype`)."""
    vram_budget: int | None = None
    """Hard cap, in bytes, on the device memory of the services (decode and prefill together): decode sizes
    the expert cache to what the memory plan leaves (`common/engine/memory_plan.py`) and refuses to start
    when that is too small to be useful. Implies offloaded experts; `expert_cache` must then be None."""
    embeddings_on_host: bool = False
    """Keep the token embedding in host memory and gather each pass's rows from there (frees its VRAM for
    the expert cache; refused for a model whose head is tied to it)."""
    fused_kernels: bool | None = None
    """The fused Triton kernels and projections (`use_fused_kernels`): None switches them on
    where the device is CUDA; False keeps every pass in torch ops (debugging, profiling)."""
    resident_dtype: str | None = None
    """`fp8`: the token mixers' projections held as fp8 codes with per-row, per-128-input scales
    (common/model/fp8_linear.py); decode quantises them at load, prefill maps them. None: `dtype`."""
    cuda_graphs: bool = True
    """On CUDA, record each lane count's decode pass once and replay it (common/engine/graphs.py); False runs
    every pass op by op (debugging, profiling)."""
    lend_kv: bool = False
    """Decode lends the KV pool's idle pages to the expert cache as slots and takes them back, stage by
    stage, before contexts need them (common/experts/kv_lending.py); prefill maps them like the rest of the
    pools."""
    lend_arena: bool = False
    """Prefill's arena serves as expert cache slots between prefills. Serving: it (a spare row and two buffers
    of E experts) lives in decode's expert pool, as the cache tables' bank: decode lends it to the cache
    between prefills and takes it back when it grants a prefill its freeze; prefill copies its experts there,
    through the pool it maps anyway. The offline engine lends its own arena's second buffer (E slots)."""
    lookahead: int | None = None
    """Decode: each MoE layer guesses the next one's top-`lookahead` experts a token (that layer's router on
    this layer's input) and copies the uncached ones into slots while it computes (0: off; None: the
    default, `resolve_lookahead`)."""
    speculative: str | None = None
    """The offline engine (`spillway generate`): `mtp` drafts tokens with the model's multi-token-prediction
    head and verifies them in one pass (greedy requests only); None: a token a pass. Not for the workers."""
    num_draft: int = 2
    """With `speculative`: tokens the MTP head drafts a step."""
    record_routing: bool = False
    """Keep the router's choices of every pass (`Engine.routing_recorder`; `spillway generate`)."""
    pin_experts: str | None = None
    """A calibration hot set (JSON `{"MoE layer index": [expert ids]}`, `load_hot_set`) whose experts stay in
    the expert cache for good."""
    grammar_max_bytes: int = GRAMMAR_MAX_BYTES
    """Largest structured-output form a worker compiles (its JSON text, in bytes): a larger one fails its
    request (a 400) before any compile; the router refuses it too, before it builds the grammar."""
    grammar_timeout_s: float = GRAMMAR_TIMEOUT_S
    """Seconds a structured request may wait for its grammar (its compile, and those queued before it, one
    at a time on the grammars' thread) before it fails (a 400); the loop steps the other requests
    meanwhile. A compile past it still runs to its end (xgrammar's cannot be stopped): a later request of
    that form finds it."""
    kernels: KernelConfig = KERNELS
    """The kernel forms and launch options the model's passes use (common/kernels/config.py), handed to the
    model where the worker builds it."""

    @property
    def model_dtype(self) -> str:
        """`dtype`, `auto` resolved for `device`: bfloat16 on CUDA, float32 on the CPU."""
        return resolve_dtype(self.dtype, self.device)


def resolve_dtype(dtype: str, device: str) -> str:
    """`dtype` on `device`, `auto` resolved: bfloat16 on CUDA (a plan is for CUDA: "cuda"), else float32."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") else "float32"


@dataclass(frozen=True)
class MemoryPlan:
    """How a `--vram-budget` is spent (docs/ARCHITECTURE.md, Memory): fixed pools first, the expert cache
    gets the rest, in whole slots. Computed from the config alone by `common.engine.memory_plan.plan_memory`;
    every pool is in bytes."""

    budget: int
    """The cap on the device memory of every process of the service together."""
    weights: int
    """Resident parameters and buffers: all but the routed experts (host memory) and host tables (the n-gram
    table), counted once however many processes map them."""
    kv: int
    """Per-request state pools: every layer's paged state × pages plus its fixed-size state × lanes."""
    arena: int
    """Expert rows outside the cache: the spare row and the two prefill arena buffers of E rows each (the
    first doubles as decode's staging rows), in decode's pool and, when prefill is a process of its own, in
    prefill's."""
    scratch: int
    """Activation workspace: one prefill chunk and one decode step (estimate: see
    `common/engine/memory_plan.py`)."""
    graphs: int
    """Reserve for CUDA contexts, library workspaces, CUDA graph pools and the allocator's fragmentation."""
    expert_cache: int
    """The expert cache: `cache_slots` expert rows plus the cache tables."""
    cache_slots: int
    """Experts the cache holds (all MoE layers together; split evenly over the layers at start)."""
    expert_bytes: int
    """Bytes of one expert in the runtime format: one cache slot, one arena row."""
    min_cache_slots: int
    """Fewest slots worth serving with (see `common.engine.memory_plan.min_cache_slots`)."""
    max_cache_slots: int
    """Every routed expert of every MoE layer (L × E): more slots than this would stay empty."""
    min_budget: int
    """The smallest budget that gives the cache `min_cache_slots` with the same settings."""
    max_context: int
    """Context per lane the KV pool is sized for (the model's max_position caps the one asked for)."""
    max_running: int
    """Decode lanes (the state pool's slots)."""
    prefill_chunk: int
    """Most prompt tokens of one prefill pass (the scratch grows with it)."""
    num_pages: int
    """KV pages of the state pool."""
    expert_format: str
    """Runtime format of the experts (an artifact's own format when the model is one)."""
    dtype: str
    """Activation and resident-weight dtype."""
    processes: int
    """Processes on the device: 2 for `spillway serve` (decode, prefill), 1 for the offline engine."""
    prefill_process: int = 0
    """Of the budget, serve's prefill worker's own bytes (it maps decode's weights, pools and cache): its
    arena rows (none with `--lend-arena`: decode's pool holds them), its prefill workspace, its reserve and
    their share of the fragmentation allowance. Each worker caps its allocator at its part (`process_budget`);
    0 with one process."""
    arena_lendable_slots: int = 0
    """With serve's `--lend-arena`, the slots prefill's arena adds to decode's cache between prefills (a
    spare row and two buffers of E rows: `prefill_arena_rows`, within the experts not cached); 0 without it
    or with one process."""
    kv_lendable_slots: int = 0
    """With `--lend-kv`, the most slots the KV pool's idle pages add to the cache: its paged state past the
    first lending stage (an eighth, common/experts/kv_lending.py) in whole slots, within the experts not
    cached."""

    def process_budget(self, role: str) -> int:
        """The cap of one process's allocator: "prefill" its own bytes, "decode" (or the one process of the
        offline engine) the rest of the budget."""
        if role not in ("prefill", "decode"):
            raise ValueError(f"no process {role!r} in the plan")
        return self.prefill_process if role == "prefill" else self.budget - self.prefill_process

    @property
    def fixed(self) -> int:
        """Every pool but the expert cache."""
        return self.weights + self.kv + self.arena + self.scratch + self.graphs

    @property
    def total(self) -> int:
        """Bytes the plan gives out (at most `budget` when `ok`)."""
        return self.fixed + self.expert_cache

    @property
    def all_experts_fit(self) -> bool:
        """The budget holds every expert: the cache is capped at L × E and never evicts."""
        return self.cache_slots >= self.max_cache_slots

    @property
    def ok(self) -> bool:
        """The cache gets at least `min_cache_slots` within the budget."""
        return self.cache_slots >= self.min_cache_slots and self.total <= self.budget

    def pools(self) -> dict[str, int]:
        """Bytes per pool, by the `pool` label of the `spillway:vram_bytes` gauge."""
        names = ("weights", "kv", "expert_cache", "arena", "scratch", "graphs")
        return {name: getattr(self, name) for name in names}

    def check(self) -> None:
        """Raise ValueError, naming the numbers and what to change, unless the plan is `ok`."""
        if self.ok:
            return
        names = ("weights", "kv", "arena", "scratch", "graphs")
        fixed = ", ".join(f"{name} {format_bytes(getattr(self, name))}" for name in names)
        left = self.budget - self.fixed
        changes = [
            f"a --vram-budget of at least {format_bytes(self.min_budget)}",
            f"a smaller --max-context (now {self.max_context}), --max-running (now {self.max_running}), "
            f"--prefill-chunk (now {self.prefill_chunk}) or --layer-major-tokens",
        ]
        if self.expert_format != "int4":
            changes.append(f"--expert-format int4 (now {self.expert_format})")
        if self.dtype == "float32":
            changes.append("--dtype bfloat16 (now float32)")
        raise ValueError(
            f"--vram-budget {format_bytes(self.budget)} ({self.budget} bytes) is too small for the expert "
            f"cache: the fixed pools take {format_bytes(self.fixed)} ({fixed}), which leaves "
            f"{format_bytes(left) if left >= 0 else 'nothing'}: {self.cache_slots} slots of "
            f"{format_bytes(self.expert_bytes)}; the cache needs at least {self.min_cache_slots} "
            f"(2·top_k per MoE layer, at most E: every expert one decode step asks for, and as many again "
            f"to keep). "
            f"Use {', or '.join(changes)}."
        )


def format_bytes(n: int) -> str:
    """`n` bytes in the largest binary unit that keeps it at least 1 (GiB at most), two decimals."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
