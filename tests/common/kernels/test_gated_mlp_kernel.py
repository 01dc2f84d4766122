"""The gated MLP's down kernel (common/kernels/gated_mlp.py) against GatedMLP.finish in torch."""

from __future__ import annotations

import pytest
import torch

from common.model.layers import GatedMLP

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows", [1, 4])
def test_swiglu_down_matches_finish(rows: int) -> None:
    """gate and up as views of one wider projection output; widths not multiples of the blocks."""
    from common.kernels.gated_mlp import swiglu_down

    gen = torch.Generator().manual_seed(rows)
    hidden, inter = 40, 200
    mlp = GatedMLP(hidden, inter, "silu")
    mlp.down_proj.weight.data = torch.randn(hidden, inter, generator=gen) * 0.1
    fused = torch.randn(rows, 3 + 2 * inter, generator=gen)  # [router | gate | up]-like
    gate, up = fused[:, 3 : 3 + inter], fused[:, 3 + inter :]
    want = mlp.finish(gate, up)
    on = fused.to(DEVICE)
    for i_block in (64, None):  # four steps; the whole (padded) width in one
        got = swiglu_down(
            on[:, 3 : 3 + inter], on[:, 3 + inter :], mlp.down_proj.weight.to(DEVICE), i_block=i_block
        )
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
