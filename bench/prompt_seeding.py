"""prompt-seeding: what counting the prompt's routing in the cache statistics does for decode's misses.

    python -m bench.prompt_seeding [--prompt 2048] [--decode 512] [--warmup 64] [--capacity 151] [--out DIR]

decode-1's routing (the synthetic-zipf trace of prompt + decode tokens, seed 0) replayed through the cache
tables on the CPU (the default policy, the runtime's rebalancing cadence) with `--capacity` slots a layer
(decode-1 on the H200 has 7,252 slots: ~151 a layer), twice: decode starting from empty statistics, and
from the prompt's tokens observed (`CacheTables.observe`, as a prefill pass does). Misses and hit rate per
decode token after `--warmup` tokens; no GPU (the tables' decisions are the device's: same ops).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.common import write_result
from common.experts.cache_tables import DEFAULT_POLICY, CacheTables
from common.experts.simulator import rebalance_every, rebalance_step
from common.experts.trace import RoutingTrace, synthetic_zipf


def decode_misses(trace: RoutingTrace, prompt: int, warmup: int, capacity: int, seeded: bool) -> float:
    """Misses per decode token after `warmup` decode tokens; `seeded`: the prompt's tokens observed first."""
    layers, k = trace.num_layers, trace.top_k
    tables = CacheTables(layers, trace.num_experts, [capacity] * layers, DEFAULT_POLICY, "cpu")
    if seeded:
        for layer in range(layers):
            tables.observe(layer, trace.ids[:prompt, layer].long())
    before = 0
    for step, token in enumerate(range(prompt, trace.num_tokens)):
        if step == warmup:
            before = int(tables.counters["misses"].sum())
        if (step + 1) % rebalance_every() == 0:  # as begin_pass before that decode pass
            tables.rebalance(slots_to_move=rebalance_step(tables))
        masks = trace.masks(token)
        for layer in range(layers):
            tables.resolve(layer, masks[layer], step=token, max_new=k)
    return (int(tables.counters["misses"].sum()) - before) / (trace.num_tokens - prompt - warmup)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=64)
    ap.add_argument("--capacity", type=int, default=151, help="cache slots per layer")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    trace = synthetic_zipf(tokens=args.prompt + args.decode, seed=0)
    torch.set_num_threads(1)  # tiny ops
    with torch.inference_mode():
        cold, seeded = (
            decode_misses(trace, args.prompt, args.warmup, args.capacity, s) for s in (False, True)
        )
    per_token = trace.num_layers * trace.top_k
    result = {
        "prompt": args.prompt,
        "decode": args.decode,
        "warmup": args.warmup,
        "capacity_per_layer": args.capacity,
        "policy": DEFAULT_POLICY,
        "misses_per_token": {"empty_statistics": cold, "prompt_observed": seeded},
        "hit_rate": {"empty_statistics": 1 - cold / per_token, "prompt_observed": 1 - seeded / per_token},
        "reduction": 1 - seeded / cold,
    }
    print(write_result("prompt-seeding", result, args.out))
    print(f"misses per decode token: {cold:.1f} from empty statistics, {seeded:.1f} from the prompt's")


if __name__ == "__main__":
    main()
