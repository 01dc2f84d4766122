"""A tuning aid for the GEMV kernel (common/kernels/gemv.py) at flashnext's decode projections.

For each projection a decode step runs (N × K from the flashnext config, and how many a step), µs per call
of cuBLAS (F.linear), of the GEMV as `choose` sets it, of the CUDA C one-row GEMV where it takes the shape
(gemv_native.py, what a decode step runs there), and of the GEMV over output rows per program, inputs
per loop step, chunks of K, warps and pipelining stages (the fastest six), for one row and for eight, each
output checked against cuBLAS's, and the share of the HBM rate (measured here) each reaches (lm_head, at
~99 % with cuBLAS, is left out). Calls are replayed from a CUDA graph, each on another copy of the weight
(more bytes than L2 holds), as a step's layers would be. The last lines: what `choose` saves a step.

    python -m bench.gemv_tune [--rows 1 8] [--fp8]
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from bench.common import measure_hbm_gbps, replay_us
from common.kernels import gemv_native
from common.kernels.gemv import CUBLAS_ROWS, SCALE_BLOCK, GemvConfig, choose, chunks, gemv, scale_blocks
from common.model.fp8_linear import dequantize_fp8, quantize_fp8
from common.model.hf_config import parse_architecture
from common.model.synthetic.config import model_config

CALLS = 24
"""Calls a timed graph makes (cycling over the weight copies)."""
COPY_BYTES = 256 << 20
"""Bytes of weight copies a shape cycles over (more than the H200's 50 MB L2)."""


FP8_PROJECTIONS = ("gdn in", "gdn out", "qsa in", "qsa out")
"""What `--resident-dtype fp8` quantises (fp8_linear.py: the token mixers')."""


def projections() -> dict[str, tuple[int, int, int]]:
    """name → (N, K, calls a decode step) of flashnext's fused decode projections."""
    hf = model_config("flashnext", "qwen4_exp", {"num_hidden_layers": 4, "mtp_num_hidden_layers": 0})
    _, c = parse_architecture(hf, Path("<flashnext>"))
    h, layers, gdn = c.hidden_size, 48, 36
    key, value = (
        c.linear_num_key_heads * c.linear_key_head_dim,
        c.linear_num_value_heads * c.linear_value_head_dim,
    )
    qsa_in = c.num_heads * c.head_dim * 2 + 2 * c.num_kv_heads * c.head_dim + (c.indexer_n_heads + 1) * 128
    moe_in = c.num_experts + 2 * c.shared_expert_intermediate_size + 1
    pad8 = lambda n: n + (-n % 8)  # fuse_linears' 16-byte rows
    return {
        "gdn in": (pad8(2 * key + 2 * value + 2 * c.linear_num_value_heads), h, gdn),
        "gdn out": (h, value, gdn),
        "qsa in": (pad8(qsa_in), h, layers - gdn),
        "qsa out": (h, c.num_heads * c.head_dim, layers - gdn),
        "moe in": (pad8(moe_in), h, layers),
        "router": (c.num_experts, h, 0),  # the lookahead's guess (offloaded decode)
    }


def settings(n: int, k: int, rows: int, fp8: bool = False) -> list[GemvConfig]:
    """The grid: rows a program, inputs a step, chunks of K, warps and stages (a few for a weight `choose`
    leaves to cuBLAS: do they confirm it?); at one or two rows, each on the CUDA cores too (a broadcast and
    a sum instead of the tensor cores' dot of x padded to 16 rows). fp8: steps of whole scale blocks."""
    if fp8:
        grid = itertools.product((16, 32, 64), (256, 512), (1, 2), (4,), (2, 3))
    elif n >= CUBLAS_ROWS:
        grid = itertools.product((16, 32), (512,), (1, 2), (4, 8), (2,))
    else:
        grid = itertools.product((16, 32), (256, 512), (1, 2, 3, 4, 5, 6, 8, 10), (4, 8), (1, 2))
    dots = (1, 3) if rows < 3 else (1,)  # dot_rows 3: one or two rows on the CUDA cores
    found = {  # the chunks a launch makes (whole BK steps a chunk), each setting once
        GemvConfig(bn=bn, bk=bk, splits=chunks(k, bk, splits)[1], warps=w, stages=st, dot_rows=dot): None
        for (bn, bk, splits, w, st), dot in itertools.product(grid, dots)
        if splits <= k // bk
    }
    return [cfg for cfg in found if not fp8 or scale_blocks(cfg)]


def time_calls(run, weights: list[torch.Tensor], x: torch.Tensor) -> float:
    """µs per call of `run(x, w)` over CALLS calls cycling through `weights`, recorded as one graph."""
    calls = [weights[i % len(weights)] for i in range(CALLS)]
    return replay_us(lambda: [run(x, w) for w in calls]) / CALLS


def label(cfg: GemvConfig | None) -> str:
    if cfg is None:
        return "cuBLAS"
    text = f"bn {cfg.bn:>2} bk {cfg.bk:>3} splits {cfg.splits:>2} warps {cfg.warps} stages {cfg.stages}"
    return text + (" cuda cores" if cfg.dot_rows > 1 else "")


def tune_shape(name: str, n: int, k: int, rows: int, hbm: float, fp8: bool = False) -> tuple[float, float]:
    """Print one shape's table; → (cuBLAS µs, `choose`'s µs). fp8: the GEMV reads the weight's e4m3 codes
    and scales (fp8_linear.quantize_fp8), cuBLAS the bf16 weight; the floor: the codes' and scales' bytes."""
    weight_bytes = n * k * (1 + 4 / SCALE_BLOCK) if fp8 else n * k * 2
    copies = max(1, min(CALLS, int(COPY_BYTES // weight_bytes)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    floor = weight_bytes / hbm / 1e3  # µs at the HBM rate
    cublas = time_calls(F.linear, weights, x)
    if fp8:
        weights = [quantize_fp8(w) for w in weights]
        want = F.linear(x, dequantize_fp8(*weights[0], x.dtype)).float()
        run = lambda x, w, cfg: gemv(x, w[0], scale=w[1], config=cfg)
    else:
        want = F.linear(x, weights[0]).float()
        run = lambda x, w, cfg: gemv(x, w, config=cfg)
    chosen = choose(rows, n, k, x.device, fp8)
    timed = {}
    grid = settings(n, k, rows, fp8)
    for cfg in [chosen, *grid] if chosen is not None else grid:
        if cfg in timed:
            continue
        try:
            err = (run(x, weights[0], cfg).float() - want).abs().max().item()
            us = time_calls(lambda x, w, cfg=cfg: run(x, w, cfg), weights, x)
        except triton.runtime.errors.OutOfResources:
            continue
        assert err < 0.05, f"{label(cfg)}: max |err| {err} against cuBLAS"  # bf16 outputs of ~0.5
        timed[cfg] = (us, err)
    ours = cublas if chosen is None else timed[chosen][0]  # (KeyError: choose's launch does not fit)
    head = f"{name} {n}x{k}, {rows} row(s): HBM floor {floor:.2f} µs"
    print(f"{head}; cuBLAS {cublas:.2f} µs ({floor / cublas:.0%}); choose ({label(chosen)}) {ours:.2f} µs")
    if not fp8 and gemv_native.takes(x, weights[0]):  # what fused_linear.linear runs instead of `choose`'s
        err = (gemv_native.gemv_row(x, weights[0]).float() - want).abs().max().item()
        us = time_calls(gemv_native.gemv_row, weights, x)
        print(
            f"  CUDA C gemv_row (gemv_native.py): {us:7.2f} µs ({floor / us:.0%} of HBM), max |err| {err:.1e}"
        )
    for cfg, (us, err) in sorted(timed.items(), key=lambda t: t[1][0])[:6]:
        print(f"  {label(cfg)}: {us:7.2f} µs ({floor / us:.0%} of HBM), max |err| {err:.1e}")
    del weights
    torch.cuda.empty_cache()
    return cublas, ours


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--fp8", action="store_true", help="the token mixers' projections in fp8 (the GEMV's)")
    args = ap.parse_args()
    hbm = measure_hbm_gbps()
    print(f"HBM {hbm:.0f} GB/s")
    for rows in args.rows:
        saved, seen = 0.0, {}
        for name, (n, k, per_step) in projections().items():
            if args.fp8 and name not in FP8_PROJECTIONS:
                continue
            if (n, k) not in seen:
                seen[n, k] = tune_shape(name, n, k, rows, hbm, args.fp8)
            cublas, ours = seen[n, k]
            saved += per_step * (cublas - ours)
        print(f"{rows} row(s): `choose` saves {saved:.0f} µs a decode step against cuBLAS (calls alone)\n")


if __name__ == "__main__":
    main()
