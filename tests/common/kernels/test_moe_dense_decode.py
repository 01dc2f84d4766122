"""The bf16 / fp8 / NVFP4 / MXFP4 decode MoE kernels (common/kernels/moe_dense.py) in Triton's interpreter
(compiled on CUDA) against the format's dequantise-then-multiply, at widths that leave partial blocks and
fp8 scale blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.experts.formats import get_format

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("fmt_name", ["bf16", "fp8", "nvfp4", "mxfp4"])
@pytest.mark.parametrize(("hidden", "inter", "block"), [(256, 128, 16), (224, 96, 32)])
def test_dense_decode_matches_the_dequantised_reference(fmt_name: str, hidden: int, inter: int, block: int):
    """bf16 / fp8 also at widths that leave partial blocks (224, 96: not multiples of 128)."""
    from common.kernels.moe_dense import moe_dense_decode

    fmt, gen = get_format(fmt_name), torch.Generator().manual_seed(hidden)
    packed = [
        fmt.pack(
            torch.randn(2 * inter, hidden, generator=gen) * 0.05,
            torch.randn(hidden, inter, generator=gen) * 0.05,
        )
        for _ in range(5)
    ]
    pool = {name: torch.stack([p[name] for p in packed]).to(DEVICE) for name in packed[0]}
    x = torch.randn(2, hidden, generator=gen).to(DEVICE)
    rows = torch.tensor([[1, 3, 3], [0, 4, 2]], device=DEVICE)  # a row twice in one token
    weights = torch.softmax(torch.randn(2, 3, generator=gen), -1).to(DEVICE)
    calls = []
    out = moe_dense_decode(x, rows, weights, pool, block=block, before_down=lambda: calls.append(1))
    gate_up, down = fmt.unpack_many({n: t[rows.reshape(-1)] for n, t in pool.items()}, torch.float32)
    h = torch.einsum("ph,pnh->pn", x.float().repeat_interleave(3, dim=0), gate_up)
    gate, up = h.chunk(2, dim=-1)
    y = torch.einsum("pi,phi->ph", F.silu(gate) * up, down) * weights.reshape(-1, 1)
    torch.testing.assert_close(out.float(), y.view(2, 3, -1).sum(1), rtol=1e-4, atol=1e-4)
    assert calls == [1]
