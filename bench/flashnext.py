"""The flashnext model the decode and prefill benchmarks run: synthetic resident weights on the GPU, int4
experts with random codes in mapped host memory, a VRAM expert cache sized to what a device-memory budget
leaves, synthetic-zipf routing replay. The int4 store is filled with random codes and scales (quantising
120B random weights would take longer than a benchmark and measure nothing more)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import measure_hbm_gbps, measure_pcie_gbps, progress
from common.config import LAYER_MAJOR_TOKENS, PREFILL_CHUNK
from common.engine.memory_plan import cap_allocator, plan_memory
from common.engine.runner import ModelRunner, state_layout
from common.experts.formats import get_format
from common.experts.kv_lending import KvLending
from common.experts.offload import OffloadedExperts, offload_experts
from common.experts.routing import RoutingReplayer, install_routing_hook, replayer_for
from common.experts.store import HostExpertStore
from common.model.fp8_linear import to_resident_dtype
from common.model.fused_kernels import use_fused_kernels
from common.model.hf_config import parse_architecture
from common.model.host_embedding import embeddings_to_host
from common.model.loader import build_model
from common.model.moe import install_lookahead
from common.model.synthetic.checkpoint import synthetic_tensors
from common.model.synthetic.config import model_config

PAGE_SIZE = 16
"""KV page size (ModelRunner's default)."""
GIB = 1 << 30


@dataclass
class Flashnext:
    """What a benchmark measures with, and the ceilings measured before building it."""

    model: torch.nn.Module
    cfg: object
    store: HostExpertStore
    runner: ModelRunner
    provider: OffloadedExperts
    slots: int
    pcie_gbps: float
    hbm_gbps: float
    build_s: float
    replayer: RoutingReplayer | None
    """The synthetic-zipf replay (None: the model's own routers choose)."""
    aliased_bytes: int = 0
    """Device memory made outside the caching allocator (KV lending's pools): not in memory_reserved."""


def random_int4_store(layers: int, experts: int, hidden: int, inter: int) -> HostExpertStore:
    """An int4 store of random experts: codes 0..15 around zero point 8, scales ~ 1/(8·√fan_in)."""
    store = HostExpertStore(layers, experts, get_format("int4").components(hidden, inter))
    pattern = torch.randint(0, 256, (1 << 28,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    offset = 0
    for parts in store.parts:
        for name, block in parts.items():
            if name.endswith("qweight"):  # tile a random pattern at shifting offsets: 62 GB in seconds
                flat = block.view(-1)
                for start in range(0, flat.numel(), pattern.numel() // 2):
                    n = min(pattern.numel() // 2, flat.numel() - start)
                    offset = (offset + 4099) % (pattern.numel() // 2)
                    flat[start : start + n].copy_(pattern[offset : offset + n])
            elif name.endswith("zeros"):
                block.fill_(8)
            else:  # scales
                block.fill_(1.0 / (8 * (hidden if name.startswith("gate_up") else inter) ** 0.5))
    return store


def random_fp4_store(fmt_name: str, layers: int, experts: int, hidden: int, inter: int) -> HostExpertStore:
    """An NVFP4 or MXFP4 store of random experts: random codes, block scales ~ 1/(3·√fan_in) (global 1)."""
    store = HostExpertStore(layers, experts, get_format(fmt_name).components(hidden, inter))
    pattern = torch.randint(0, 256, (1 << 28,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for parts in store.parts:
        for name, block in parts.items():
            fan_in = hidden if name.startswith("gate_up") else inter
            if name.endswith(("_weight", "_blocks")):  # tiled as the int4 store's codes
                flat = block.view(torch.uint8).view(-1)
                for start in range(0, flat.numel(), pattern.numel()):
                    n = min(pattern.numel(), flat.numel() - start)
                    flat[start : start + n].copy_(pattern[:n])
            elif name.endswith("_scales"):  # e8m0
                block.fill_(127 + round(math.log2(1 / (3 * fan_in**0.5))))
            elif name.endswith("_weight_scale"):
                block.copy_(torch.full(block.shape, 1 / (3 * fan_in**0.5)).to(block.dtype))
            else:  # global and input scales
                block.fill_(1.0)
    return store


def build_flashnext(
    layers: int,
    budget_gib: float,
    lanes: int,
    context: int,
    trace_tokens: int,
    policy: str = "lfu-admit",
    eager: bool = False,
    fused: bool = True,
    all_fit: bool = False,
    prefill_chunk: int = PREFILL_CHUNK,
    layer_major_tokens: int = LAYER_MAJOR_TOKENS,
    lend: bool = False,
    embeddings_on_host: bool = False,
    resident_dtype: str | None = None,
    lend_kv: bool = False,
    lookahead: int = 0,
    routing: str = "synthetic-zipf",
    expert_format: str = "int4",
) -> Flashnext:
    """Measure PCIe and HBM, then build flashnext cut to `layers` for `lanes` × `context` tokens, its cache
    the slots the memory plan gives `budget_gib` (one process; a prefill of `prefill_chunk` tokens in
    layer-major groups of `layer_major_tokens`), or
    every expert with `all_fit`, loaded up front; `lend`: the arena's second buffer serves as E more slots
    between prefills; `embeddings_on_host`: the token embedding in host memory, its bytes to the cache;
    `resident_dtype` "fp8": the token mixers' projections in fp8; `lend_kv`: the KV pool's idle pages serve
    as cache slots (common/experts/kv_lending.py; the allocator's cap is the budget less that memory);
    `lookahead`: each MoE layer guesses the next one's top-n experts a token and copies them in ahead
    (`install_lookahead`); `routing` "model": the random-weight routers choose; `expert_format`: the store's.
    The allocator is capped at the budget (`cap_allocator`: an undercounting plan fails as out-of-memory)."""
    hf = model_config(
        "flashnext",
        "qwen4_exp",
        {"num_hidden_layers": layers, "ngram_vocab_size_base": 2_000_000, "mtp_num_hidden_layers": 0},
    )
    arch, cfg = parse_architecture(hf, Path("<flashnext in memory>"))
    pcie, hbm = measure_pcie_gbps(), measure_hbm_gbps()
    progress(f"ceilings measured: PCIe {pcie:.1f} GB/s, HBM {hbm:.0f} GB/s")
    torch.cuda.empty_cache()  # the probes' buffers must not count against the budget
    t0 = time.perf_counter()
    not_expert = lambda key: ".mlp.experts." not in key
    source = ((Path("<synthetic>"), k, lambda t=t: t) for k, t in synthetic_tensors(hf, keep=not_expert))
    model = build_model(
        arch, cfg, source, Path("<synthetic>"), torch.bfloat16, "cuda", external_experts=True, fuse=fused
    )
    if embeddings_on_host:
        embeddings_to_host(model)
    if resident_dtype is not None:
        to_resident_dtype(model, resident_dtype)
    progress("resident weights built")
    dims = (len(cfg.moe_layers), cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
    fp4 = expert_format != "int4"
    store = random_fp4_store(expert_format, *dims) if fp4 else random_int4_store(*dims)
    progress("host expert store filled")
    lending = None
    if lend_kv:  # its runner comes after the cache, whose tables it lends to
        lending = KvLending(*state_layout(model, lanes, context, PAGE_SIZE, None), PAGE_SIZE, "cuda")
    else:
        runner = ModelRunner(model, max_running=lanes, max_context=context, cuda_graphs=not eager)
    torch.cuda.empty_cache()  # generating the synthetic weights left cached blocks behind: free them, and
    torch.cuda.reset_peak_memory_stats()  # count the peak from here (a served model loads from its files)
    slots = len(cfg.moe_layers) * cfg.num_experts  # all_fit: as many slots as experts, whatever it takes
    if not all_fit:
        plan = plan_memory(
            cfg, arch, budget_bytes=int(budget_gib * GIB), max_context=context, max_running=lanes,
            expert_format=expert_format, dtype=torch.bfloat16, prefill_chunk=prefill_chunk, processes=1,
            layer_major_tokens=layer_major_tokens,
            embeddings_on_host=embeddings_on_host, fused_kernels=fused, resident_dtype=resident_dtype,
        )  # fmt: skip
        plan.check()
        slots = plan.cache_slots
        if lending is None:
            cap_allocator(plan.budget, "cuda")
    provider = offload_experts(
        model, str(slots), policy, expert_format, store=store, lend_arena=lend, kv_lending=lending
    )
    if lending is not None:
        runner = ModelRunner(
            model, max_running=lanes, max_context=context, cuda_graphs=not eager, kv_lending=lending
        )
        if not all_fit:
            cap_allocator(plan.budget - lending.memory.total_bytes, "cuda")
    if all_fit:
        provider.load_all()
    use_fused_kernels(model, fused, runner.backend)
    install_lookahead(model, lookahead, cfg.num_layers)
    replayer = None
    if routing == "synthetic-zipf":
        trace = f"synthetic-zipf:tokens={trace_tokens},seed=0"
        replayer = replayer_for(trace, list(cfg.moe_layers), cfg.num_experts, cfg.top_k)
        install_routing_hook(model, replayer)
    progress(f"flashnext built: {slots} cache slots")
    aliased = lending.memory.total_bytes if lending is not None else 0
    return Flashnext(
        model, cfg, store, runner, provider, slots, pcie, hbm, time.perf_counter() - t0, replayer, aliased
    )


def warm_prefill(flash: Flashnext, lengths: set[int]) -> None:
    """Prefill throwaway sequences of each chunk length first, so that a timed prefill measures the work and
    not the first call's Triton compilation and autotuning (fla-core's chunked kernels: tens of seconds on a
    fresh machine); then replay routing from the trace's start again. The warm-up leaves no trace in the
    cache (`untracked`: its statistics, counters and traffic put back)."""
    vocab, runner = flash.cfg.vocab_size, flash.runner
    with flash.provider.untracked():  # the timed prompt's routing is counted once, by its own passes
        for length in sorted(lengths - {0}):
            seq = runner.new_sequence()
            tokens = torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(7)).tolist()
            runner.forward([seq], [tokens])
            runner.release(seq)
    torch.cuda.synchronize()
    if flash.replayer is not None:
        flash.replayer.rewind()
