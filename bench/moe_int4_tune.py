"""A tuning aid for the int4 decode MoE kernels (common/kernels/moe_int4.py): µs per call of
`moe_int4_decode` at flashnext's expert shape (H 2560, I 640, top-10) for one and eight tokens, over output
rows per program, groups per loop step and warps, and the bandwidth each reaches (expert bytes read / time,
against the HBM rate measured here). Calls are replayed from a CUDA graph, each on other pool rows (a pool
larger than L2), as a decode step's 48 layers would be.

    python -m bench.moe_int4_tune [--tokens 1 8] [--rows 4096]
"""

from __future__ import annotations

import argparse
import itertools

import torch

from bench.common import measure_hbm_gbps, replay_us
from bench.flashnext import random_int4_store
from common.kernels.moe_int4 import moe_int4_decode

HIDDEN, INTER, TOP_K, CALLS = 2560, 640, 10, 48


def time_config(pool: dict, tokens: int, block: int, groups: int, warps: int, repeats: int = 20) -> float:
    """µs per call: CALLS calls on random pool rows recorded as one graph, replayed `repeats` times."""
    n = pool["down_qweight"].shape[0]
    x = torch.randn(CALLS, tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    rows = torch.stack([torch.randperm(n, device="cuda")[: tokens * TOP_K] for _ in range(CALLS)])
    rows = rows.view(CALLS, tokens, TOP_K)
    weights = torch.softmax(torch.randn(CALLS, tokens, TOP_K, device="cuda"), -1)

    def calls() -> None:
        for c in range(CALLS):
            moe_int4_decode(x[c], rows[c], weights[c], pool, block, None, groups, warps)

    return replay_us(calls, repeats) / CALLS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rows", type=int, default=4096, help="pool rows (experts) the calls read from")
    args = ap.parse_args()
    hbm = measure_hbm_gbps()
    store = random_int4_store(1, args.rows, HIDDEN, INTER)
    pool = {name: block.cuda() for name, block in store.parts[0].items()}  # [rows, ...] each
    expert_bytes = store.expert_bytes
    print(f"HBM {hbm:.0f} GB/s; expert {expert_bytes / 2**20:.2f} MiB")
    for tokens in args.tokens:
        results = []
        for block, groups, warps in itertools.product((8, 16, 32), (1, 2, 4, 8), (2, 4, 8)):
            if INTER % block:
                continue
            us = time_config(pool, tokens, block, groups, warps)
            results.append((us, block, groups, warps))
        floor = tokens * TOP_K * expert_bytes / (hbm * 1e3)  # µs to read the experts once at the HBM rate
        print(f"tokens {tokens}: HBM floor {floor:.1f} µs per call")
        for us, block, groups, warps in sorted(results)[:12]:
            setting = f"block {block:>2} groups/step {groups} warps {warps}"
            print(f"  {setting}: {us:7.2f} µs ({floor / us:.0%} of HBM)")


if __name__ == "__main__":
    main()
