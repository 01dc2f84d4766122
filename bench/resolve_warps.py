"""How fast the one-program cache resolution (common/kernels/resolve.py) runs for flashnext's shape (48 MoE
layers × 512 experts, top-10, ~30 % cached) at each warp count: 48 calls recorded as one CUDA graph, the
graph replayed, µs per call, for one token's choices a layer (decode-1) or eight's (decode-8). A tuning aid,
not a benchmark with a limit.

    python -m bench.resolve_warps [--layers 48] [--experts 512] [--slots 154] [--tokens 1 8] [--warps 4]
"""

from __future__ import annotations

import argparse

import torch

from bench.common import replay_us
from common.experts.cache_tables import CacheTables
from common.kernels.resolve import resolve_step


def time_warps(layers: int, experts: int, slots: int, warps: int, tokens: int = 1, steps: int = 50) -> float:
    """µs per resolve_step call with `warps` warps for `tokens` tokens' top-10, over `steps` replays of a
    graph of one call per layer."""
    tables = CacheTables(layers, experts, [slots] * layers, "lfu-admit", device="cuda")
    step = torch.zeros((), dtype=torch.int64, device="cuda")
    moved = torch.zeros(4, layers, dtype=torch.int64, device="cuda")
    ids = torch.randint(0, experts, (layers, tokens * 10), device="cuda")  # uniform: more misses than a trace

    def one_pass() -> None:
        step.add_(1)
        for layer in range(layers):
            resolve_step(tables, layer, ids[layer], step, moved, num_warps=warps)

    return replay_us(one_pass, steps, between=lambda: ids.random_(0, experts)) / layers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=512)
    ap.add_argument("--slots", type=int, default=154)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1])
    ap.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = ap.parse_args()
    for tokens in args.tokens:
        for warps in args.warps:
            us = time_warps(args.layers, args.experts, args.slots, warps, tokens)
            print(f"tokens {tokens}, num_warps {warps:>2}: {us:7.2f} µs per layer")


if __name__ == "__main__":
    main()
