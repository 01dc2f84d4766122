"""Norm + RoPE in one kernel against OffsetRMSNorm then apply_rotary: partial rotary, a strided input (a
view of a wider projection, as QSA's q is), heads of 32 and 64."""

from __future__ import annotations

import pytest
import torch

from common.model.qwen4_exp.norms import OffsetRMSNorm
from common.model.rope import apply_rotary

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("dim", "rot"), [(32, 16), (64, 64)])
def test_norm_rope_matches_torch(dim: int, rot: int) -> None:
    from common.kernels.norm_rope import norm_rope

    gen = torch.Generator().manual_seed(dim)
    tokens, heads = 3, 4
    norm = OffsetRMSNorm(dim, 1e-6)
    norm.weight.data = torch.randn(dim, generator=gen) * 0.1
    wide = torch.randn(tokens, heads, 2 * dim, generator=gen)
    x = wide[..., :dim]  # strided, as a chunk of q_proj's output
    angles = torch.rand(tokens, rot // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    want = apply_rotary(norm(x), cos, sin)
    on = lambda t: t.to(DEVICE)
    got = norm_rope(on(wide)[..., :dim], on(norm.weight.data), norm.eps, on(cos), on(sin))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
