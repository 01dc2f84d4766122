"""A tuning aid for a decode step's hyper-connection input (common/kernels/hyper.py) at flashnext's shape: 4
streams of 2,560, the mix-down and inject projections fused (328 × 10,240 bf16 with their padding), mix-up
10,240 × 320.

µs per sublayer, one and eight rows, for each way to go from the raw streams to the sublayer's input:
- `torch`: hc_norm, cuBLAS for mix-down/inject, the division and SiLU, cuBLAS for mix-up, hc_mix;
- `mix-up`: hc_norm, cuBLAS, then hc_mix_up (block, warps swept);
- `project`: hc_project (columns a program and warps swept; a program a stream), then hc_mix_up
  normalising and summing its partial products (two blocks).
Calls are replayed from a CUDA graph, 96 sublayers a replay each with its own weights (more than L2 holds), as
a decode step's would be. The rate is the weight bytes read per call (13.3 MB) over the time. Each variant's
output is checked against `torch`'s.

    python -m bench.hc_decode_tune [--rows 1 8]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from bench.common import measure_hbm_gbps, replay_us
from common.kernels.hyper import hc_mix, hc_mix_up, hc_norm, hc_project

HC, HIDDEN, RANK, N_OUT, CALLS, EPS = 4, 2560, 320, 328, 96, 1e-6


def sublayers(rows: int) -> list[dict]:
    """CALLS sublayers' inputs and weights, bf16 on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(rows)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, device="cuda", generator=gen) * scale).bfloat16()

    return [
        {
            "streams": randn(rows, HC * HIDDEN, scale=3.0),
            "norm": randn(HC * HIDDEN, scale=0.2),
            "fused": randn(N_OUT, HC * HIDDEN, scale=0.02),
            "up": randn(HC * HIDDEN, RANK, scale=0.05),
        }
        for _ in range(CALLS)
    ]


def torch_path(c: dict) -> torch.Tensor:
    normed = hc_norm(c["streams"], c["norm"], EPS, HC)
    down = F.linear(normed, c["fused"])[:, :RANK]
    return hc_mix(F.linear(F.silu(down / HC), c["up"]), normed, HC)


def mix_up_path(c: dict, mix: dict) -> torch.Tensor:
    normed = hc_norm(c["streams"], c["norm"], EPS, HC)
    down = F.linear(normed, c["fused"])[:, :RANK]
    return hc_mix_up(down, c["up"], normed, HC, **mix)


def project_path(c: dict, block_n: int, warps: int, mix: dict) -> torch.Tensor:
    parts, scales, _ = hc_project(
        c["streams"], c["norm"], EPS, c["fused"], HC, block_n=block_n, num_warps=warps
    )
    return hc_mix_up(
        parts[..., :RANK], c["up"], c["streams"], HC, scales=scales, norm_weight=c["norm"], **mix
    )


def mix_label(mix: dict) -> str:
    return f"block {mix['block']} warps {mix['num_warps']}"


def variants() -> dict:
    out = {"torch": torch_path}
    for block, warps in itertools.product((4, 8, 16), (2, 4, 8)):
        mix = {"block": block, "num_warps": warps}
        out[f"mix-up {mix_label(mix)}"] = lambda c, m=mix: mix_up_path(c, m)
    for bn, warps, mix_block in itertools.product((1, 2, 4), (2, 4, 8), (4, 8)):
        mix = {"block": mix_block, "num_warps": 4}
        name = f"project n {bn} warps {warps} + {mix_label(mix)}"
        out[name] = lambda c, n=bn, w=warps, m=mix: project_path(c, n, w, m)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    hbm = measure_hbm_gbps()
    weight_bytes = (N_OUT * HC * HIDDEN + HC * HIDDEN * RANK) * 2
    print(f"HBM {hbm:.0f} GB/s; {weight_bytes / 1e6:.1f} MB of weights a sublayer, {CALLS} a replay")
    for rows in args.rows:
        cases = sublayers(rows)
        want = [torch_path(c).float() for c in cases]
        results = []
        for name, path in variants().items():
            err = max((path(c).float() - w).abs().max().item() for c, w in zip(cases, want, strict=True))
            us = replay_us(lambda p=path, cs=cases: [p(c) for c in cs]) / CALLS
            results.append((us, name, err))
        print(f"\n{rows} row(s):")
        for us, name, err in sorted(results):
            print(f"  {name:>58}: {us:6.2f} µs, {weight_bytes / us / 1e3:6.0f} GB/s, max diff {err:.1e}")


if __name__ == "__main__":
    main()
