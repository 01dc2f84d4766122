"""A tuning aid for the dense MoE kernels (common/kernels/moe_dense.py, moe_dense_grouped.py) on 4-bit float
experts at flashnext's expert shape (H 2560, I 640, top-10), beside the int4 kernels at their defaults.

Decode (default): µs per call of `moe_dense_decode` for one and eight tokens over output rows per program and
warps, replayed from one CUDA graph of 48 calls on other layers' pool rows (moe_int4_tune's `decode_calls`),
each output checked against the first shape's; the share of the HBM floor (the experts a call reads, once, at
the HBM rate measured here) each reaches; and `moe_int4_decode` on an int4 pool of the same calls.

`--grouped`: ms per call of `moe_dense_grouped` for 25,600 tokens routed uniformly over 512 experts, over
`GroupedConfig`, beside `moe_int4_grouped` at its default.

    python -m bench.dense_tune [--format nvfp4|mxfp4] [--grouped] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
from pathlib import Path

import torch

from bench.common import measure_hbm_gbps, median_ms, progress, replay_us, write_result
from bench.flashnext import random_fp4_store, random_int4_store
from bench.moe_int4_tune import CALLS, EXPERTS, HIDDEN, INTER, TOP_K, decode_calls
from common.kernels.config import decode_config
from common.kernels.moe_dense import moe_dense_decode
from common.kernels.moe_dense_grouped import moe_dense_grouped
from common.kernels.moe_int4 import moe_int4_decode
from common.kernels.moe_int4_grouped import GROUPED, GroupedConfig, moe_int4_grouped

DECODE_SHAPES = list(itertools.product((8, 16, 32, 64), (2, 4, 8)))
"""(output rows per program, warps)."""
GROUPED_SHAPES = [
    GROUPED,
    *(GroupedConfig(*s) for s in itertools.product((64, 128), (64, 128), (4, 8), (2, 3))),
]


def _pools(fmt: str, rows: int) -> tuple[dict, dict, int]:
    """Device pools of `rows` random experts in `fmt` and in int4, and the fp4 expert's bytes."""
    fp4 = random_fp4_store(fmt, 1, rows, HIDDEN, INTER)
    int4 = random_int4_store(1, rows, HIDDEN, INTER)
    return _on_device(fp4), _on_device(int4), fp4.expert_bytes


def _on_device(store) -> dict:
    return {n: b.cuda() for n, b in store.parts[0].items()}


def decode_sweep(fmt: str, rows: int) -> dict:
    """Per token count: the HBM floor, int4's µs per call and each dense shape's, fastest first."""
    pool, int4_pool, expert_bytes = _pools(fmt, rows)
    hbm = measure_hbm_gbps()
    out: dict = {"hbm_gbps": hbm, "expert_bytes": expert_bytes}
    for tokens in (1, 8):
        calls = decode_calls(int4_pool, tokens)
        int4 = functools.partial(moe_int4_decode, pool=int4_pool, config=decode_config(tokens))
        int4_us = _per_call(int4, calls)
        want = moe_dense_decode(*calls[0], pool, block=DECODE_SHAPES[0][0], num_warps=DECODE_SHAPES[0][1])
        shapes = []
        for block, warps in DECODE_SHAPES:
            run = functools.partial(moe_dense_decode, pool=pool, block=block, num_warps=warps)
            error = ((run(*calls[0]).float() - want.float()).norm() / want.float().norm()).item()
            assert error < 1e-2, f"block {block} warps {warps}: {error:.1e} from the first shape"
            shapes.append({"block": block, "warps": warps, "us": _per_call(run, calls)})
        used = sum(c[1].unique().numel() for c in calls) / CALLS
        floor = used * expert_bytes / (hbm * 1e3)
        shapes.sort(key=lambda s: s["us"])
        out[f"tokens_{tokens}"] = {"hbm_floor_us": floor, "int4_us": int4_us, "shapes": shapes}
        print(f"tokens {tokens}: floor {floor:.1f} µs, int4 {int4_us:.1f} µs")
        for s in shapes[:6]:
            share = f"{floor / s['us']:.0%} of HBM"
            print(f"  block {s['block']:>2} warps {s['warps']}: {s['us']:7.1f} µs ({share})")
        progress(f"decode, {tokens} tokens")
    return out


def _per_call(run, calls: list) -> float:
    """µs per call of `run` over `calls`, replayed as one CUDA graph."""
    return replay_us(lambda: [run(*c) for c in calls]) / CALLS


def grouped_sweep(fmt: str, tokens: int = 25600) -> dict:
    """ms per call of the grouped kernels over GROUPED_SHAPES, fastest first, and int4's at GROUPED."""
    pool, int4_pool, _ = _pools(fmt, EXPERTS)
    rows = torch.arange(EXPERTS, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    ids = torch.rand(tokens, EXPERTS, device="cuda", generator=gen).topk(TOP_K, dim=-1).indices
    weights = torch.softmax(torch.randn(tokens, TOP_K, device="cuda", generator=gen), -1)
    int4 = functools.partial(moe_int4_grouped, x, ids, weights, rows, int4_pool, GROUPED)
    int4()
    int4_ms = median_ms(int4, 3)
    want = moe_dense_grouped(x, ids, weights, rows, pool, GROUPED).float()
    shapes = []
    for config in GROUPED_SHAPES:
        call = functools.partial(moe_dense_grouped, x, ids, weights, rows, pool, config)
        try:
            error = ((call().float() - want).norm() / want.norm()).item()
            ms = median_ms(call, 3)
        except Exception as failure:  # e.g. out of shared memory at the largest tiles
            print(f"  {config}: {type(failure).__name__}")
            continue
        shapes.append({"config": dataclasses.astuple(config), "ms": ms, "error": error})
    shapes.sort(key=lambda s: s["ms"])
    print(f"grouped, {tokens} tokens: int4 {int4_ms:.2f} ms")
    for s in shapes[:6]:
        print(f"  {s['config']}: {s['ms']:.2f} ms (error {s['error']:.0e})")
    progress("grouped")
    return {
        "tokens": tokens,
        "int4_ms": int4_ms,
        "fields": [f.name for f in dataclasses.fields(GROUPED)],
        "shapes": shapes,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", default="nvfp4", choices=["nvfp4", "mxfp4"])
    ap.add_argument("--rows", type=int, default=4096, help="pool rows the decode calls read")
    ap.add_argument("--grouped", action="store_true", help="also the prefill kernels")
    ap.add_argument("--out", type=Path, default=None, help="write dense-tune-<format>.json there")
    args = ap.parse_args()
    result = {"format": args.format, "decode": decode_sweep(args.format, args.rows)}
    if args.grouped:
        result["grouped"] = grouped_sweep(args.format)
    if args.out is not None:
        write_result(f"dense-tune-{args.format}", result, args.out)


if __name__ == "__main__":
    main()
