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
    parts, scales = hc_project(on["s"], on["nw"], norm.eps, on["w"], hc, block_n=4, block_k=16)
    assert parts.shape == (hc, rows, n_out)  # one partial product a stream
    got = parts.sum(0)
    torch.testing.assert_close(got.cpu(), F.linear(normed, weight), rtol=1e-5, atol=1e-5)
    want_scales = torch.rsqrt(streams.unflatten(-1, (hc, hidden)).pow(2).mean(-1) + norm.eps)
    torch.testing.assert_close(scales.cpu(), want_scales, rtol=1e-5, atol=1e-6)
    want = hc_mix_up(got[:, :rank], on["up"], normed.to(DEVICE), hc).cpu()
    # the partials summed as they are read
    mixed = hc_mix_up(parts[..., :rank], on["up"], on["s"], hc, scales=scales, norm_weight=on["nw"])
    torch.testing.assert_close(mixed.cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("parts", [0, 4])
def test_inject_from_a_view_or_partial_products(parts: int) -> None:
    """hc_inject against its torch form, the logits read as a fused product's strided last columns (0) or
    as hc_project's partial products [P, T, hc], summed in the kernel."""
    from common.kernels.hyper import hc_inject

    gen = torch.Generator().manual_seed(11 + parts)
    rows, hc, hidden = 3, 4, 40
    streams = torch.randn(rows, hc * hidden, generator=gen)
    out = torch.randn(rows, hidden, generator=gen)
    product = torch.randn(max(parts, 1), rows, 7 + hc, generator=gen)
    logits = product[..., 7:] if parts else product[0, :, 7:]  # [P, T, hc] or [T, hc], strided
    weight = 2 * torch.sigmoid(logits.sum(0) / hc if parts else logits / hc)  # [T, hc]
    want = streams + (out[:, None, :] * weight[:, :, None]).flatten(-2)
    got = hc_inject(streams.to(DEVICE), out.to(DEVICE), logits.to(DEVICE), block=16)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
