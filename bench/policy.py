"""policy: the cache simulator on the standard synthetic-zipf trace at 30 % of each layer's experts cached.

    python -m bench.policy [--trace synthetic-zipf] [--capacity 0.3] [--out DIR]

The standard workload (bench/README.md) runs it at 20, 30 and 40 % (`policy-20.json`, `policy.json`,
`policy-40.json`).

Replays every policy with equal per-layer capacity, the default policy with adaptive per-layer capacity (the
runtime's `CacheTables.rebalance`, at the runtime's cadence and step), Belady's optimum and the static
oracle (see common/experts/simulator.py), and writes bench/results/policy.json (or DIR/policy.json).

The target (decode-speed issue): the default policy with adaptive capacity has at least 25 % fewer misses
than LRU with equal per-layer capacity. The limit is Belady's optimum (a shared pool of the same total
size, so free of any partition): `limit_ratio = belady_misses / default_adaptive_misses` (1.0 is perfect).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.common import write_result
from common.experts.cache_tables import DEFAULT_POLICY
from common.experts.simulator import ADAPTIVE, format_table, simulate, slots_per_layer
from common.experts.trace import parse_trace

TARGET_REDUCTION = 0.25


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default="synthetic-zipf", help="a trace file or synthetic-zipf[:KEY=VAL,...]")
    ap.add_argument("--capacity", type=float, default=0.3, help="cached fraction of each layer's experts")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    trace = parse_trace(args.trace)
    start = time.perf_counter()
    result = simulate(trace, args.capacity)
    elapsed = time.perf_counter() - start
    misses, steady = result["misses"], result["steady"]["misses"]
    adaptive = DEFAULT_POLICY + ADAPTIVE
    belady = misses["belady"]
    figures = {
        "limit_ratio": belady / misses[adaptive],
        "limit_ratio_definition": f"belady_misses / misses['{adaptive}'] over the whole trace (1.0: optimal)",
        "trace": args.trace,
        "capacity": args.capacity,
        "cache_slots": slots_per_layer(args.capacity, trace.num_experts) * trace.num_layers,
        "layers": trace.num_layers,
        "experts": trace.num_experts,
        "top_k": trace.top_k,
        "tokens": trace.num_tokens,
        "default_policy": DEFAULT_POLICY,
        "accesses": result["accesses"],
        "misses": misses,
        "misses_over_belady": {name: n / belady for name, n in misses.items()},
        "reduction_vs_lru": {name: 1 - n / misses["lru"] for name, n in misses.items()},
        "default_adaptive_reduction_vs_lru": 1 - misses[adaptive] / misses["lru"],
        "default_reduction_vs_lru": 1 - misses[DEFAULT_POLICY] / misses["lru"],
        "target_reduction_vs_lru": TARGET_REDUCTION,
        "target_met": 1 - misses[adaptive] / misses["lru"] >= TARGET_REDUCTION,
        "warmup_tokens": result["warmup_tokens"],
        "steady": {
            "accesses": result["steady"]["accesses"],
            "misses": steady,
            "misses_over_belady": {name: n / steady["belady"] for name, n in steady.items()},
            "reduction_vs_lru": {name: 1 - n / steady["lru"] for name, n in steady.items()},
        },
        "simulate_s": elapsed,
    }
    steady_reduction = figures["steady"]["reduction_vs_lru"]
    name = "policy" if args.capacity == 0.3 else f"policy-{round(args.capacity * 100)}"  # the target's: 30 %
    path = write_result(name, figures, args.out)
    print(format_table(result, args.capacity))
    print(
        f"{adaptive}: {figures['default_adaptive_reduction_vs_lru']:.1%} fewer misses than lru "
        f"(target {TARGET_REDUCTION:.0%}: {'met' if figures['target_met'] else 'NOT met'}); "
        f"{misses[adaptive] / belady:.3f}x belady's (limit_ratio {figures['limit_ratio']:.3f}); "
        f"{DEFAULT_POLICY} with equal capacity: {figures['default_reduction_vs_lru']:.1%}; after the first "
        f"{result['warmup_tokens']} tokens (a warm cache): {steady_reduction[adaptive]:.1%}"
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
