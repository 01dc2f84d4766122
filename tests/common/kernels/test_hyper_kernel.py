"""The hyper-connection kernels (common/kernels/hyper.py) against the torch they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows", [1, 3])
def test_mix_up_matches_gemv_then_mix(rows: int) -> None:
    """hc_mix_up (the mix-up GEMV inside the mix) against silu(down / hc) → Linear → hc_mix's torch form,
    down read as a strided view (a fused projection's first columns), rank and hidden not powers of two."""
    from common.kernels.hyper import hc_mix_up

    gen = torch.Generator().manual_seed(rows)
    hc, hidden, rank = 4, 40, 20  # 40 columns: a masked tail of 16-column blocks
    fused = torch.randn(rows, rank + 4, generator=gen)
    down = fused[:, :rank]
    weight = torch.randn(hc * hidden, rank, generator=gen) * 0.3
    normed = torch.randn(rows, hc * hidden, generator=gen)
    up = F.linear(F.silu(down / hc), weight)  # [T, hc·H]
    gate = torch.sigmoid(up).unflatten(-1, (hc, hidden))
    want = (gate * normed.unflatten(-1, (hc, hidden))).mean(dim=-2)
    got = hc_mix_up(fused.to(DEVICE)[:, :rank], weight.to(DEVICE), normed.to(DEVICE), hc, block=16)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3])
def test_project_and_mix_up_from_raw_streams(rows: int) -> None:
    """hc_project (the norm applied as the streams are read, then the GEMV) against hc_norm's torch form and
    a Linear; hc_mix_up normalising the raw streams with its scales against the same on the normalised
    streams. Widths not multiples of the blocks."""
    from common.kernels.hyper import hc_mix_up, hc_project
    from common.model.qwen4_exp.norms import OffsetRMSNorm

    gen = torch.Generator().manual_seed(5 + rows)
    hc, hidden, rank, n_out = 4, 40, 20, 27
    norm = OffsetRMSNorm(hc * hidden, 1e-6, group=hidden)
    norm.weight.data = torch.randn(hc * hidden, generator=gen) * 0.2
    streams = torch.randn(rows, hc * hidden, generator=gen) * 3
    weight = torch.randn(n_out, hc * hidden, generator=gen) * 0.1
    up = torch.randn(hc * hidden, rank, generator=gen) * 0.3
    normed = norm(streams)
    on = {
        name: t.to(DEVICE)
        for name, t in (("s", streams), ("nw", norm.weight.data), ("w", weight), ("up", up))
    }
    got, scales = hc_project(on["s"], on["nw"], norm.eps, on["w"], hc, block_n=4, block_k=16)
    torch.testing.assert_close(got.cpu(), F.linear(normed, weight), rtol=1e-5, atol=1e-5)
    want_scales = torch.rsqrt(streams.unflatten(-1, (hc, hidden)).pow(2).mean(-1) + norm.eps)
    torch.testing.assert_close(scales.cpu(), want_scales, rtol=1e-5, atol=1e-6)
    down = got[:, :rank]
    mixed = hc_mix_up(down, on["up"], on["s"], hc, scales=scales, norm_weight=on["nw"])
    torch.testing.assert_close(
        mixed.cpu(), hc_mix_up(down, on["up"], normed.to(DEVICE), hc).cpu(), rtol=1e-5, atol=1e-5
    )
