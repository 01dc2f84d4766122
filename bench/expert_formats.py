"""expert-formats: the error each expert format adds, beside the distortion-rate bound (CPU, or a GPU if any).

    python -m bench.expert_formats [--rows 256] [--cols 512] [--state-bits 16] [--out DIR]

One weight matrix [rows, cols] of i.i.d. N(0, 1) weights, and the same with outlier input channels (1 % of
the columns ×10), through int4 g128, NVFP4, MXFP4 and the trellis codes at 2, 2.5, 3, 3.5 and 4 bits a
weight. Per format: bits a weight (its bytes for an expert of H = cols, I = rows / 2, over 3·H·I weights),
the mean squared error per weight relative to the weights' variance (the Gaussian source's distortion), and
the bound 2^(−2R) at its rate R. Trellis rows also report the encoder's seconds per billion weights on the
device used. Writes bench/results/expert-formats.json.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.common import progress, write_result
from common.experts.formats import TRELLIS_RATES, get_format
from common.model.trellis_blocks import TrellisCode, decode_matrix, encode_matrix

BASELINES = ("int4", "nvfp4", "mxfp4")


def relative_mse(w: torch.Tensor, back: torch.Tensor) -> float:
    """Mean squared error per weight over the weights' mean square."""
    return float((back.float() - w).pow(2).mean() / w.pow(2).mean())


def baseline_mse(name: str, w: torch.Tensor) -> tuple[float, float]:
    """(bits a weight, relative MSE) of format `name` on w [2I, H] as an expert's gate_up."""
    fmt = get_format(name)
    rows, cols = w.shape
    down = torch.zeros(cols, rows // 2)
    gate_up, _ = fmt.unpack(fmt.pack(w, down), torch.float32)
    return fmt.expert_nbytes(cols, rows // 2) * 8 / w.numel() / 1.5, relative_mse(w, gate_up)


def trellis_mse(rate: str, w: torch.Tensor, state_bits: int) -> tuple[float, float, float]:
    """(bits a weight, relative MSE, encode seconds) of the trellis code at `rate` on w."""
    code = TrellisCode(state_bits, TRELLIS_RATES[rate])
    start = time.perf_counter()
    codes, scales = encode_matrix(w, code)
    if w.is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    bits = (codes.numel() + 2 * scales.numel()) * 8 / w.numel()
    return bits, relative_mse(w, decode_matrix(codes, scales, code)), seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--cols", type=int, default=512)
    ap.add_argument("--state-bits", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    gaussian = torch.randn(args.rows, args.cols, generator=g)
    outliers = gaussian.clone()
    outliers[:, torch.randperm(args.cols, generator=g)[: max(1, args.cols // 100)]] *= 10
    sources = {"gaussian": gaussian, "outliers": outliers}
    formats: dict[str, dict] = {}
    for name in BASELINES:
        row: dict = {}
        for source, w in sources.items():
            row["bits_per_weight"], row[f"mse_{source}"] = baseline_mse(name, w)
        row["bound"] = 2 ** (-2 * row["bits_per_weight"])
        formats[name] = row
        progress(f"{name}: {row}")
    for rate in TRELLIS_RATES:
        row = {}
        for source, w in sources.items():
            bits, row[f"mse_{source}"], seconds = trellis_mse(rate, w.to(device), args.state_bits)
            row["bits_per_weight"], row["encode_s_per_billion"] = bits, seconds / w.numel() * 1e9
        row["bound"] = 2 ** (-2 * float(rate))
        formats[f"trellis{rate}"] = row
        progress(f"trellis{rate}: {row}")
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "rows": args.rows,
        "cols": args.cols,
        "state_bits": args.state_bits,
        "formats": formats,
    }
    print(write_result("expert-formats", result, args.out))
    print(f"{'format':>12} {'bits':>6} {'mse gauss':>10} {'mse outl':>10} {'2^-2R':>8}")
    for name, row in formats.items():
        print(
            f"{name:>12} {row['bits_per_weight']:6.3f} {row['mse_gaussian']:10.4f} "
            f"{row['mse_outliers']:10.4f} {row['bound']:8.4f}"
        )


if __name__ == "__main__":
    main()
