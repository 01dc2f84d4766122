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
