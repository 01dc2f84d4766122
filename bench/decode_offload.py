"""decode-1: flashnext (qwen4_exp) with int4 experts in mapped host memory, a VRAM expert cache sized
so the process stays under a device-memory budget, synthetic-zipf routing replay, one request.

    python -m bench.decode_offload --budget-gib 32 --prompt 2048 --decode 256 [--layers 48] [--out DIR]

The int4 expert store is filled with random codes and scales (quantising 120B random weights would take
longer than the benchmark and measures nothing more); the rest of the model is the synthetic preset.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.common import measure_hbm_gbps, measure_pcie_gbps, write_result
from common.experts.formats import get_format
from common.experts.offload import offload_experts
from common.experts.routing import install_routing_hook, replayer_for
from common.experts.store import HostExpertStore
from common.kernels import use_fused_decode
from common.model.hf_config import parse_architecture
from common.model.loader import build_model
from common.model.synthetic import model_config, synthetic_tensors
from common.runner import ModelRunner

GIB = 1 << 30


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


def profile_steps(runner: ModelRunner, seq, token: int, path: Path, steps: int = 4) -> None:
    """Op tables (by device time and by host time) of `steps` decode steps: where a step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            token = int(runner.forward([seq], [[token]]).argmax(-1))
        torch.cuda.synchronize()
    table = prof.key_averages()
    path.write_text(
        table.table(sort_by="cuda_time_total", row_limit=40)
        + "\n"
        + table.table(sort_by="self_cpu_time_total", row_limit=40)
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--budget-gib", type=float, default=32.0)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=64)
    ap.add_argument("--policy", default="lfu-admit")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--eager", action="store_true", help="run decode passes op by op (no CUDA graphs)")
    ap.add_argument("--fused", action="store_true", help="the opt-in fused decode kernels (common/kernels)")
    ap.add_argument("--profile", type=Path, default=None, help="write a torch profile of 4 steady steps here")
    args = ap.parse_args()

    hf = model_config(
        "flashnext",
        "qwen4_exp",
        {"num_hidden_layers": args.layers, "ngram_vocab_size_base": 2_000_000, "mtp_num_hidden_layers": 0},
    )
    arch, cfg = parse_architecture(hf, Path("<flashnext in memory>"))
    pcie, hbm = measure_pcie_gbps(), measure_hbm_gbps()
    torch.cuda.empty_cache()  # the probes' buffers must not count against the budget
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    not_expert = lambda key: ".mlp.experts." not in key
    source = ((Path("<synthetic>"), k, lambda t=t: t) for k, t in synthetic_tensors(hf, keep=not_expert))
    model = build_model(arch, cfg, source, Path("<synthetic>"), torch.bfloat16, "cuda", external_experts=True)
    store = random_int4_store(
        len(cfg.moe_layers), cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    )
    context = args.prompt + args.decode + 16 + 8  # + the profiled steps
    runner = ModelRunner(model, max_seqs=1, max_context=context, cuda_graphs=not args.eager)
    arena_bytes = 2 * cfg.num_experts * store.expert_bytes
    spare = args.budget_gib * GIB - torch.cuda.memory_reserved() - arena_bytes - int(2.0 * GIB)  # scratch
    slots = max(len(cfg.moe_layers), int(spare // store.expert_bytes))
    provider = offload_experts(model, str(slots), args.policy, "int4", store=store)
    use_fused_decode(model, args.fused)
    install_routing_hook(
        model,
        replayer_for(
            f"synthetic-zipf:tokens={args.prompt + args.decode},seed=0",
            list(cfg.moe_layers),
            cfg.num_experts,
            cfg.top_k,
        ),
    )
    build_s = time.perf_counter() - t0

    prompt = torch.randint(
        3, cfg.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    seq = runner.new_sequence()
    t0 = time.perf_counter()
    token = int(runner.forward([seq], [prompt]).argmax(-1))
    torch.cuda.synchronize()
    ttft = time.perf_counter() - t0
    marks = {}
    for step in range(args.decode):
        if step == args.warmup:
            torch.cuda.synchronize()
            marks = {
                "t": time.perf_counter(),
                "bytes": sum(provider.traffic().cache_bytes),
                **{k: int(v.sum()) for k, v in provider.tables.counters.items()},
            }
        token = int(runner.forward([seq], [[token]]).argmax(-1))
    torch.cuda.synchronize()
    steady = args.decode - args.warmup
    elapsed = time.perf_counter() - marks["t"]
    counters = {k: int(v.sum()) - marks[k] for k, v in provider.tables.counters.items()}
    accesses = counters["hits"] + counters["misses"]
    h2d = (
        sum(provider.traffic().cache_bytes) - marks["bytes"] + counters["bypasses"] * store.expert_bytes
    ) / steady
    if args.profile is not None:
        profile_steps(runner, seq, token, args.profile)
    resident = sum(p.numel() * p.element_size() for p in model.parameters())
    hbm_bytes = resident + cfg.top_k * len(cfg.moe_layers) * store.expert_bytes  # per token, at least
    t_limit = max(h2d / (pcie * 1e9), hbm_bytes / (hbm * 1e9))
    tok_s = steady / elapsed
    result = {
        "limit_ratio": t_limit * tok_s,
        "pcie_gbps": pcie,
        "hbm_gbps": hbm,
        "tok_per_s": tok_s,
        "ttft_s": ttft,
        "hit_rate": counters["hits"] / max(accesses, 1),
        "misses_per_token": counters["misses"] / steady,
        "bypasses_per_token": counters["bypasses"] / steady,
        "h2d_bytes_per_token": h2d,
        "cache_slots": slots,
        "expert_bytes": store.expert_bytes,
        "max_memory_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
        "budget_gib": args.budget_gib,
        "layers": args.layers,
        "policy": args.policy,
        "build_s": build_s,
        "cuda_graphs": not args.eager,
        "fused_decode": args.fused,
    }
    print(write_result("decode-1", result, args.out))
    for k, v in result.items():
        print(f"{k:>24}: {v:.4g}" if isinstance(v, float) else f"{k:>24}: {v}")


if __name__ == "__main__":
    main()
