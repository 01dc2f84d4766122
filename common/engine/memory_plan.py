"""The memory plan: how a `--vram-budget` is split among the device pools, from the config alone.

Nothing is loaded: a meta-device model (`empty_model`) gives the shapes and dtypes. The pools
(docs/ARCHITECTURE.md, Memory), in bytes:

- `weights`: the meta model's parameters and buffers (tied ones once); routed experts and host tables (PLE's
  n-gram table) are not counted.
- `kv`: a meta `StatePool` of `model.state_specs(dtype)`, K/V in `kv_dtype`.
- `arena`: beside the cache's S slots, a spare row and two arena buffers of E rows: (1 + 2E) expert rows;
  a decode process under `spillway serve` keeps one buffer: (1 + E).
- `scratch`: the activation workspace estimate (`scratch_terms`).
- `graphs`: `PROCESS_RESERVE` a process plus `FRAGMENTATION` of the budget.
- `expert_cache`: the rest, in whole expert slots with their `CacheTables` (linear in the slots), capped at
  every expert (L × E).

`MemoryPlan.check` refuses a plan whose cache gets fewer than `min_cache_slots`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from common.config import (
    LAYER_MAJOR_TOKENS,
    MOE_DOWN_TOKENS,
    PREFILL_CHUNK,
    MemoryPlan,
    ModelConfig,
    WorkerConfig,
    format_bytes,
)
from common.engine.runner import state_layout
from common.experts.cache_tables import CacheTables
from common.experts.formats import ExpertFormat, get_format
from common.experts.kv_lending import STAGES
from common.experts.offload import parse_capacity
from common.experts.prefill_path import prefill_arena_rows
from common.experts.traffic import TRAFFIC_ROWS
from common.kernels import fused_by_default
from common.kv.backend import TorchPagedBackend
from common.kv.state import StatePool
from common.model.architectures import get_architecture
from common.model.fp8_linear import Fp8Linear, largest_dequantized, to_resident_dtype
from common.model.fused_linear import GEMV_ROWS
from common.model.hf_config import load_architecture, read_json
from common.model.host_embedding import embeddings_to_host
from common.model.loader import ARTIFACT_META, meta_model
from common.model.quantization import detect_quantization
from common.model.qwen4_exp.config import Qwen4ExpConfig
from common.model.registry import Architecture
from common.sampling.logit_processors import table_bytes as penalty_table_bytes

MiB, GiB = 1 << 20, 1 << 30
PROCESS_RESERVE = 512 * MiB
"""Per process on the device: its CUDA context (a few hundred MiB; not measured here), cuBLAS and Triton
workspaces, and captured decode graphs' private pools."""
FRAGMENTATION = 0.02
"""Share of the budget kept free for the caching allocator (2 MiB rounding of large blocks, fragmentation of
the activation workspace)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgt", start=1):
    _UNITS |= {_p: 1024**_i, f"{_p}i": 1024**_i, f"{_p}ib": 1024**_i, f"{_p}b": 1000**_i}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*")


def parse_size(text: str) -> int:
    """`32GiB`, `32G`, `500MiB`, `1.5GiB`, `4096` (bytes) → bytes. K, M, G, T with or without `i`/`iB` are
    binary (a GPU's "32 GB" is 32 GiB); `KB`, `MB`, `GB`, `TB` are decimal. Case does not matter."""
    match = _SIZE.fullmatch(text.lower())
    if match is None or match[2] not in _UNITS:
        raise ValueError(f"size {text!r} is not a number of bytes with an optional unit (e.g. 32GiB, 500MiB)")
    return int(float(match[1]) * _UNITS[match[2]])


def min_cache_slots(cfg: ModelConfig) -> int:
    """Fewest slots worth serving with: 2·k per MoE layer (at most E). One decode step of one request asks
    for k experts of each layer; a cache smaller than that misses on every step, and one of exactly k only
    keeps what the last step used. As many again gives the policy room to keep what recurs. Batches share
    much of their experts and misses beyond the cache are served from host memory (bypass), so this does not
    grow with the lanes."""
    return len(cfg.moe_layers) * min(cfg.num_experts, 2 * cfg.top_k)


def weight_bytes(model: nn.Module) -> int:
    """Resident bytes: parameters and buffers, tied ones once (routed experts and host tables are neither)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.nbytes for t in tensors.values())


def state_bytes(
    model: nn.Module,
    dtype: torch.dtype,
    kv_dtype: torch.dtype | str | None,
    max_running: int,
    max_context: int,
    page_size: int,
):
    """(bytes, pages, paged bytes) of the state pool a `ModelRunner` would allocate (built on the meta
    device): state in `dtype`, attention K/V in `kv_dtype` (None: `dtype`), as the runner builds it; the
    paged part is what KV lending can lend."""
    specs, pages = state_layout(model, max_running, max_context, page_size, kv_dtype, dtype)
    pool = StatePool(specs, pages, page_size, max_running, "meta")
    paged = sum(t.nbytes for layer in pool.layers for t in layer.paged.values())
    return sum(t.nbytes for t in pool.named_tensors().values()), pages, paged


def _tensors_nbytes(obj: object) -> int:
    """Bytes of the tensors among `obj`'s attributes (directly, or in lists and dicts)."""
    total = 0
    for value in vars(obj).values():
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]
        total += sum(t.nbytes for t in items if isinstance(t, torch.Tensor))
    return total


def table_bytes(num_layers: int, num_experts: int, slots: int) -> int:
    """Device bytes of the cache tables for `slots` slots (built on the meta device), plus the provider's
    per-layer traffic counters and the arena's expert ids."""
    tables = CacheTables(
        num_layers, num_experts, parse_capacity(str(slots), num_layers, num_experts), device="meta"
    )
    return _tensors_nbytes(tables) + 8 * (TRAFFIC_ROWS * num_layers + num_experts)


def _linear_outputs(module: nn.Module) -> int:
    return sum(m.out_features for m in module.modules() if isinstance(m, nn.Linear | Fp8Linear))


def _dequant_bytes(fmt: ExpertFormat, hidden: int, inter: int, dtype: torch.dtype) -> int:
    """Device bytes of dequantising one expert for the reference expert MLPs: the weights in `dtype` (none for
    bf16 experts read as bf16: a view), and for fp8/int4 the fp32 working set of the larger weight (gate_up,
    2·H·I: uint8 codes, fp32 codes, their shifted copy, fp32 product — 13 bytes an element)."""
    out = 0 if fmt.name == "bf16" and dtype == torch.bfloat16 else 3 * hidden * inter * dtype.itemsize
    return out + (0 if fmt.name == "bf16" else 13 * 2 * hidden * inter)


def _pass_bytes(model: nn.Module, cfg: ModelConfig, tokens: int, seqs: int, dtype: torch.dtype) -> int:
    """Activations of one forward pass of `tokens` tokens of `seqs` sequences that every layer has:

    - per token, the residual streams R (hc·H with hyper-connections) 4× (the streams, their normed copy,
      the mixing gate or the sublayer's input, the sum) and twice the widest sub-block's (token mixer, MLP,
      PLE, hyper-connection) total linear output width W: its projections' outputs live at once, plus one
      elementwise transform of each (activation, conv, norm, RoPE, gate, cast); and a norm of the streams,
      which runs in fp32 (its fp32 copy, square and product: 12·R bytes);
    - per token of a MoE layer, routing in fp32/int64: the router's softmax over E, the top-k weights, ids and
      the sort that groups them (4·E + 48·k bytes);
    - the logits of each sequence's last token in fp32 and sampling's [B, V] temporaries (16 fp32 copies,
      several of them int64 hash noise).
    """
    b = dtype.itemsize
    streams = getattr(cfg, "hc_count", 1) * cfg.hidden_size
    blocks = [block for layer in model.get_submodule("model.layers").children() for block in layer.children()]
    widest = max((_linear_outputs(block) for block in blocks), default=0)
    per_token = b * (4 * streams + 2 * widest) + 12 * streams
    if cfg.moe_layers:
        per_token += 4 * cfg.num_experts + 48 * cfg.top_k
    return tokens * per_token + seqs * cfg.vocab_size * 4 * 16


def _held_bytes(cfg: ModelConfig, tokens: int, dtype: torch.dtype) -> int:
    """Layer-major prefill (`ModelRunner.prefill_layer_major`): what the group's other `tokens` tokens hold
    while one chunk computes — their residual streams (hc·H in `dtype`) and rotary tables (cos and sin, fp32,
    head_dim each)."""
    streams = getattr(cfg, "hc_count", 1) * cfg.hidden_size
    return max(tokens, 0) * (streams * dtype.itemsize + 2 * 4 * cfg.head_dim)


def _linear_attention_bytes(cfg: ModelConfig, tokens: int, dtype: torch.dtype) -> int:
    """Gated DeltaNet layers (qwen4_exp): q/k repeated to the value heads and the fp32 core output (the torch
    path's; fla reads q/k as they are and returns the core in the model dtype, so this errs high on CUDA),
    and the chunked kernel's per-chunk fp32 states (one [Hv, Dk, Dv] per 64 tokens)."""
    if "linear_attention" not in cfg.layer_types:
        return 0
    assert isinstance(cfg, Qwen4ExpConfig)  # the one architecture with these layers
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    per_token = 2 * hv * dk * dtype.itemsize + hv * dv * 4
    return tokens * per_token + -(-tokens // 64) * hv * dk * dv * 4


def _indexer_bytes(cfg: ModelConfig, tokens: int, context: int) -> int:
    """QSA layers (qwen4_exp): each query's scores over every compressed block of its context in fp32 (and
    their masked copy) — top-k needs them all — plus the chosen key positions (int64), and one query
    slice's per-head scores (`QSAIndexer.score_bytes`; twice while their sum over heads is taken)."""
    if "indexed_attention" not in cfg.layer_types:
        return 0
    from common.model.qwen4_exp.qsa import QSAIndexer

    assert isinstance(cfg, Qwen4ExpConfig)  # the one architecture with these layers
    blocks = -(-context // cfg.indexer_compress_ratio)
    per_head = min(tokens * cfg.indexer_n_heads * blocks * 4, QSAIndexer.score_bytes)
    return tokens * (2 * blocks * 4 + (cfg.indexer_budget + cfg.indexer_compress_ratio) * 8) + 2 * per_head


def _attention_bytes(cfg: ModelConfig, tokens: int, context: int, dtype: torch.dtype) -> int:
    """Prefill attention in the torch backend (dense passes; QSA's selected ones run the paged kernel, whose
    output is all it allocates, so this errs high for them):
    it attends in query slices whose scores and fp32 softmax (4 + b bytes a score, b = the dtype's size) fit
    `TorchPagedBackend.score_bytes`; at its peak a slice holds the masked scores, the fp32 softmax and the
    rounded probabilities (2b + 4 bytes a score). Beside them: the gathered keys and values of the context
    (and an fp32 copy of one while fp8 pages are read) and the output's slices, their concatenation and the
    valid rows (3 copies of [T, Hq, D])."""
    b = dtype.itemsize
    scores = min(cfg.num_heads * tokens * context, TorchPagedBackend.score_bytes // (4 + b))
    kv = context * cfg.num_kv_heads * cfg.head_dim * (2 * b + 4)
    out = 3 * tokens * cfg.num_heads * cfg.head_dim * b
    return scores * (2 * b + 4) + kv + out


def _expert_mlp_bytes(
    cfg: ModelConfig, fmt: ExpertFormat, tokens: int, dtype: torch.dtype, decode: bool, kernels: bool = False
) -> int:
    """The routed expert MLP. Prefill, the larger of two paths: `grouped_expert_mlp` (one expert at a time:
    the output accumulator and one expert's rows of x, gate_up, the activated product and y — at most every
    token — plus one expert dequantised) and the grouped int4 kernels (`moe_int4_grouped`: every (token,
    choice) pair's activated row and grouping indices, the output rows of one down slice of
    `MOE_DOWN_TOKENS` tokens and their fp32 sum over choices, and the [T, H] result). Decode
    (`batched_expert_mlp`): every (token, choice) gathers its expert's packed row and dequantises it at once
    (T·k experts), and its 1-row products; with `kernels` and int4 experts, the int4 decode kernels read
    the codes in place and keep each pair's fp32 activation and output rows."""
    if not cfg.moe_layers:
        return 0
    h, i, k, b = cfg.hidden_size, cfg.moe_intermediate_size, cfg.top_k, dtype.itemsize
    one = _dequant_bytes(fmt, h, i, dtype)
    if decode and kernels and fmt.name == "int4" and cfg.hidden_act == "silu":  # what runs them
        return tokens * k * 4 * (i + h) + tokens * h * (4 + b)
    if decode:
        return tokens * k * (fmt.expert_nbytes(h, i) + one + b * (4 * i + 3 * h))
    rows = min(tokens, MOE_DOWN_TOKENS)  # the down projection's slice (its [n·k, H] output rows)
    grouped = tokens * k * (b * i + 5 * 8) + rows * k * b * h + rows * h * 4 + tokens * h * b
    return max(tokens * b * 4 * (h + i) + one, grouped)


def scratch_terms(
    model: nn.Module,
    cfg: ModelConfig,
    fmt: ExpertFormat,
    dtype: torch.dtype,
    *,
    max_context: int,
    max_running: int,
    prefill_chunk: int,
    fused_kernels: bool = True,
    layer_major_tokens: int = LAYER_MAJOR_TOKENS,
) -> tuple[int, int]:
    """Activation workspace (prefill, decode) in bytes, an estimate meant to err high. Prefill: one chunk (at
    most the context; one request at a time) with the rest of its layer-major group held (`_held_bytes`) and
    the MoE over the whole group (its [T, H] input and output, the expert MLP's buffers). Decode: a step of
    every lane (`_pass_bytes`, the expert MLPs and, for qwen4_exp, the linear-attention and indexer terms).
    Each also holds the penalties' per-lane token counts. One process needs the larger, two the sum.
    `fused_kernels`: decode's int4 experts go through the int4 kernels, nothing dequantised (else the
    reference path's dequantised experts dominate the decode term). Prefill attention is the torch backend's
    in query slices (`_attention_bytes`); decode attention is too small to count."""
    chunk = min(prefill_chunk, max_context)
    group = max(chunk, min(layer_major_tokens, max_context))  # a layer-major group's MoE runs over all of it
    dequantized = largest_dequantized(model) * (4 + dtype.itemsize)  # an fp8 weight, fp32 then `dtype`
    prefill = (
        dequantized
        + _pass_bytes(model, cfg, chunk, 1, dtype)
        + _attention_bytes(cfg, chunk, max_context, dtype)
        + _expert_mlp_bytes(cfg, fmt, group, dtype, decode=False)
        + _linear_attention_bytes(cfg, chunk, dtype)
        + _indexer_bytes(cfg, chunk, max_context)
        + _held_bytes(cfg, group - chunk, dtype)
        + (2 * group * cfg.hidden_size * dtype.itemsize if group > chunk else 0)  # the MoE's input, output
        + penalty_table_bytes(max_running, cfg.vocab_size)
    )
    decode = (
        (dequantized if max_running > GEMV_ROWS else 0)
        + _pass_bytes(model, cfg, max_running, max_running, dtype)
        + _expert_mlp_bytes(cfg, fmt, max_running, dtype, decode=True, kernels=fused_kernels)
        + _linear_attention_bytes(cfg, max_running, dtype)
        + _indexer_bytes(cfg, max_running, max_context)
        + penalty_table_bytes(max_running, cfg.vocab_size)
    )
    return prefill, decode


@functools.lru_cache(maxsize=32)
def _table_line(num_layers: int, num_experts: int) -> tuple[int, int]:
    """(fixed, per slot) bytes of the cache tables: their size is linear in the slots (sized at L and 2L)."""
    one, two = (table_bytes(num_layers, num_experts, n * num_layers) for n in (1, 2))
    per_slot = (two - one) // num_layers
    return one - per_slot * num_layers, per_slot


def _cache_slots(avail: int, num_layers: int, num_experts: int, expert_bytes: int) -> int:
    """Most slots whose rows and tables fit in `avail` bytes, capped at L × E."""
    fixed, per_slot = _table_line(num_layers, num_experts)
    return max(0, min(num_layers * num_experts, (avail - fixed) // (expert_bytes + per_slot)))


def _cache_bytes(num_layers: int, num_experts: int, slots: int, expert_bytes: int) -> int:
    """The cache's rows and tables."""
    fixed, per_slot = _table_line(num_layers, num_experts)
    return fixed + slots * (expert_bytes + per_slot)


def arena_rows(experts: int, processes: int) -> int:
    """Expert rows beside the cache's slots: a spare row and the arena's buffers of E rows each — two where
    prompts are prefilled (one process: the engine; two: the prefill worker), one in a serving decode worker
    (its staging rows; see OffloadedExperts)."""
    return prefill_arena_rows(experts) + (processes - 1) * (1 + experts)


def plan_memory(
    cfg: ModelConfig,
    arch: Architecture | None = None,
    *,
    budget_bytes: int,
    max_context: int,
    max_running: int,
    expert_format: str,
    dtype: torch.dtype,
    kv_dtype: torch.dtype | str | None = None,
    page_size: int = 16,
    prefill_chunk: int = PREFILL_CHUNK,
    layer_major_tokens: int = LAYER_MAJOR_TOKENS,
    processes: int = 2,
    embeddings_on_host: bool = False,
    fused_kernels: bool = True,
    resident_dtype: str | None = None,
    lend_arena: bool = False,
) -> MemoryPlan:
    """The plan for serving `cfg` within `budget_bytes` (see the module docstring); `processes` is 2 for
    `spillway serve` (decode and prefill each hold an arena, a context and a workspace), 1 for the offline
    engine; `embeddings_on_host`: the token embedding is a host table (no device bytes); `fused_kernels`:
    the fused kernels' workspace (on CUDA by default) rather than the torch ops'; `resident_dtype` "fp8":
    the token mixers' projections in fp8 (and the workspace to dequantise one for a prefill); `lend_arena`
    (serve's `--lend-arena`): prefill's arena rows are decode's (its bank), so the prefill process's own
    bytes leave them out (the arena's total is the same). Not checked:
    call `MemoryPlan.check()` to refuse a cache that is too small."""
    if budget_bytes <= 0:
        raise ValueError(f"--vram-budget must be positive, got {budget_bytes} bytes")
    if not cfg.moe_layers:
        raise ValueError("the model has no MoE layer: there are no experts to plan a cache for")
    arch = arch or get_architecture(cfg.model_type)
    fmt = get_format(expert_format)
    model = meta_model(arch, cfg, dtype)
    if embeddings_on_host:
        embeddings_to_host(model)  # as the engine does: the plan's model is the served model
    if resident_dtype is not None:
        to_resident_dtype(model, resident_dtype)
    context = min(cfg.max_position, max_context)  # as Engine caps it
    kv, pages, paged = state_bytes(model, dtype, kv_dtype, max_running, context, page_size)
    layers, experts = len(cfg.moe_layers), cfg.num_experts
    eb = fmt.expert_nbytes(cfg.hidden_size, cfg.moe_intermediate_size)
    arena = arena_rows(experts, processes) * eb
    prefill_scratch, decode_scratch = scratch_terms(
        model, cfg, fmt, dtype, max_context=context, max_running=max_running,
        prefill_chunk=prefill_chunk, fused_kernels=fused_kernels, layer_major_tokens=layer_major_tokens,
    )  # fmt: skip
    scratch = prefill_scratch + decode_scratch if processes > 1 else max(prefill_scratch, decode_scratch)
    graphs = processes * PROCESS_RESERVE + math.ceil(FRAGMENTATION * budget_bytes)
    # serve's prefill worker maps decode's weights, pools and cache: its own are a pool of arena rows (with
    # no slots), its workspace and its reserve, plus their share of the fragmentation allowance
    own_arena = 0 if lend_arena else arena_rows(experts, 1) * eb
    own = own_arena + prefill_scratch + PROCESS_RESERVE if processes > 1 else 0
    weights = weight_bytes(model)
    fixed = weights + kv + arena + scratch + graphs
    slots = _cache_slots(budget_bytes - fixed, layers, experts, eb)
    least = min_cache_slots(cfg)
    # The smallest budget B with B ≥ (fixed pools but the fragmentation share) + the least cache + 2 %·B.
    base = fixed - graphs + processes * PROCESS_RESERVE + _cache_bytes(layers, experts, least, eb)
    return MemoryPlan(
        budget=budget_bytes,
        weights=weights,
        kv=kv,
        arena=arena,
        scratch=scratch,
        graphs=graphs,
        expert_cache=_cache_bytes(layers, experts, slots, eb),
        cache_slots=slots,
        expert_bytes=eb,
        min_cache_slots=least,
        max_cache_slots=layers * experts,
        min_budget=math.ceil(base / (1 - FRAGMENTATION)) + 1,
        max_context=context,
        max_running=max_running,
        prefill_chunk=prefill_chunk,
        num_pages=pages,
        expert_format=fmt.name,
        dtype=str(dtype).removeprefix("torch."),
        processes=processes,
        prefill_process=own + math.ceil(FRAGMENTATION * own),
        arena_lendable_slots=(
            min(prefill_arena_rows(experts), layers * experts - slots) if lend_arena and processes > 1 else 0
        ),
        kv_lendable_slots=min(layers * experts - slots, paged * (STAGES - 1) // STAGES // eb),
    )


def use_expandable_segments() -> None:
    """Have the CUDA caching allocator grow and shrink its segments in place (`expandable_segments`) rather
    than cache blocks of every size it was once asked for. A long prompt's chunks each see a longer context,
    so their buffers never repeat a size: on the H200, prefill-128k reserved 34.5 GiB under a 32 GiB budget
    without it, 26.9 GiB (26.3 live) with it; capped without it (`cap_allocator`), the allocator kept freeing
    and re-reserving and the prefill stalled. Call it before CUDA starts; a setting already in
    PYTORCH_CUDA_ALLOC_CONF wins."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments" in conf:
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [conf, "expandable_segments:True"]))
    if torch.cuda.is_available():  # the variable may have been read already (at torch's import, by version)
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def cap_allocator(budget_bytes: int, device: torch.device | str) -> None:
    """Make `budget_bytes` a hard cap on what this process's caching allocator reserves on `device` (nothing
    off CUDA). The plan is an estimate; the cap is the guarantee: past it the allocator first frees its cached
    blocks and retries, and raises out-of-memory only when live tensors alone would pass it. Pair it with
    `use_expandable_segments`: with fixed segments a prompt whose buffers keep changing size makes every
    allocation near the cap free and re-reserve (prefill-128k stalled so on the H200)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return
    index = torch.cuda.current_device() if dev.index is None else dev.index  # the call needs an index
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), index)


def artifact_format(model_dir: str | Path) -> str | None:
    """The expert format of a `spillway convert` artifact (which it is served in whatever is asked), or None
    for a plain checkpoint."""
    meta = Path(model_dir) / ARTIFACT_META
    return read_json(meta)["format"] if meta.is_file() else None


def plan_for_dir(model_dir: str | Path, *, expert_format: str, mtp: bool = False, **kwargs) -> MemoryPlan:
    """`plan_memory` for the model in `model_dir` (config.json only; an artifact's experts in its format, a
    checkpoint's published NVFP4 / MXFP4 experts in theirs);
    `mtp`: with the checkpoint's MTP head (speculative decoding builds it: weights, state, a MoE layer)."""
    arch, cfg = load_architecture(model_dir)
    if mtp and isinstance(cfg, Qwen4ExpConfig) and cfg.checkpoint_mtp_layers:
        cfg = dataclasses.replace(cfg, mtp_layers=cfg.checkpoint_mtp_layers)
    fmt = artifact_format(model_dir) or detect_quantization(model_dir).expert_format or expert_format
    return plan_memory(cfg, arch, expert_format=fmt, **kwargs)


AUTO_FORMATS = ("bf16", "fp8", "int4")
"""`--expert-format auto`'s candidates, fewest bits lost first."""


def auto_plan(plan_of: Callable[[str], MemoryPlan]) -> MemoryPlan:
    """`--expert-format auto` under a budget, from `plan_of(format)` for each of AUTO_FORMATS: the first
    whose cache holds every expert (nothing offloaded: nothing lost to speed or bits); else, of the plans
    that hold, the one with the most cache slots (with experts offloaded, the misses' copies set decode's
    pace: the smallest format misses least and moves the fewest bytes a miss); else the last plan the
    model's shapes take (refused: its `check` names what would fit). A format the shapes do not take
    (int4's 128-wide groups) is passed over."""
    plans = []
    for fmt in AUTO_FORMATS:
        try:
            plan = plan_of(fmt)
        except ValueError:
            if fmt == AUTO_FORMATS[0]:
                raise
            continue
        if plan.ok and plan.cache_slots >= plan.max_cache_slots:
            return plan
        plans.append(plan)
    holding = [p for p in plans if p.ok]
    return max(holding, key=lambda p: p.cache_slots) if holding else plans[-1]


def worker_plan(cfg: WorkerConfig) -> MemoryPlan:
    """The plan of `spillway serve`'s workers (decode and prefill on one device), unchecked."""
    if cfg.vram_budget is None:
        raise ValueError("no --vram-budget to plan for")
    return plan_for_dir(
        cfg.model_dir,
        expert_format=cfg.expert_format,
        budget_bytes=cfg.vram_budget,
        max_context=cfg.max_context,
        max_running=cfg.max_running,
        dtype=DTYPES[cfg.model_dtype],
        page_size=cfg.page_size,
        kv_dtype=cfg.kv_dtype,
        prefill_chunk=cfg.prefill_chunk,
        layer_major_tokens=cfg.layer_major_tokens,
        processes=2,
        embeddings_on_host=cfg.embeddings_on_host,
        fused_kernels=fused_by_default(cfg.fused_kernels, cfg.device),
        resident_dtype=cfg.resident_dtype,
        lend_arena=cfg.lend_arena,
    )


def cap_worker(cfg: WorkerConfig, role: str) -> MemoryPlan | None:
    """Before a `spillway serve` worker ("decode" or "prefill") touches CUDA: its allocator capped at its
    part of the plan (`MemoryPlan.process_budget`), so the two together stay within `--vram-budget`; the
    plan, or None without a budget or off CUDA. Prefill, whose buffers change size with every prompt, also
    gets expandable segments (`use_expandable_segments`): it exports nothing, so their CUDA IPC caveats
    (a different handle kind, pidfd_getfd in containers) cannot reach it; decode, which exports its buffers
    through cudaIpcMemHandle, keeps fixed segments: its pools are allocated once, at start."""
    if cfg.vram_budget is None or torch.device(cfg.device).type != "cuda":
        return None
    plan = worker_plan(cfg)
    if not plan.ok:  # decode refuses it with the numbers and what to change (`MemoryPlan.check`)
        return plan
    if role == "prefill":
        use_expandable_segments()
    cap_allocator(plan.process_budget(role), cfg.device)
    return plan


def plan_dict(plan: MemoryPlan) -> dict:
    """The plan as JSON-ready values: every field, bytes per pool, the total and whether it is accepted."""
    return {
        **dataclasses.asdict(plan),
        "pools": plan.pools(),
        "total": plan.total,
        "all_experts_fit": plan.all_experts_fit,
        "ok": plan.ok,
    }


def format_plan(plan: MemoryPlan) -> str:
    """A table of the pools in GiB, then the cache's slots."""
    rows = [*plan.pools().items(), ("total", plan.total), ("budget", plan.budget)]
    lines = [f"{name:<13}{n / GiB:>10.3f} GiB {n:>16} B" for name, n in rows]
    share = plan.cache_slots / plan.max_cache_slots * 100
    lines.append(
        f"cache slots  {plan.cache_slots:>10} of {plan.max_cache_slots} experts ({share:.1f} %, "
        f"{format_bytes(plan.expert_bytes)} each in {plan.expert_format}); at least {plan.min_cache_slots}"
        + (": every expert fits" if plan.all_experts_fit else "")
    )
    lines.append(
        f"for {plan.max_running} lanes × {plan.max_context} tokens ({plan.num_pages} KV pages), "
        f"{plan.dtype}, {plan.processes} process{'es' if plan.processes > 1 else ''} on the device"
    )
    if plan.processes > 1:
        caps = (f"{role} {format_bytes(plan.process_budget(role))}" for role in ("decode", "prefill"))
        lines.append("allocator caps: " + ", ".join(caps))
    lines.append(
        f"--lend-kv: up to {plan.kv_lendable_slots} more slots while contexts stay within the KV pool's "
        "first eighth"
    )
    if plan.arena_lendable_slots:
        lines.append(f"--lend-arena: {plan.arena_lendable_slots} more slots between prefills (its arena)")
    return "\n".join(lines)
