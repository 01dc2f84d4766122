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


def test_norm_rope_stores_the_key_and_value_as_write_kv() -> None:
    """With `store`: the rotated keys and the values (a strided view, as QSA's v of its fused projection)
    land in their pages at the tokens' slots, bit for bit what write_kv writes; the other slots untouched."""
    from common.kernels.norm_rope import norm_rope
    from common.kv.backend import kv_specs, write_kv
    from common.kv.state import StatePool

    gen = torch.Generator().manual_seed(5)
    tokens, heads, dim = 3, 2, 32
    x = torch.randn(tokens, heads, dim, generator=gen).to(DEVICE)
    fused = torch.randn(tokens, heads * dim * 3, generator=gen).to(DEVICE)
    v = fused[:, heads * dim : 2 * heads * dim].view(tokens, heads, dim)  # rows of 3·H·D
    weight, cos, sin = torch.zeros(dim, device=DEVICE), torch.ones(tokens, 16), torch.zeros(tokens, 16)
    slots = torch.tensor([9, 2, 30], device=DEVICE)
    pools = [StatePool([kv_specs(heads, dim, torch.float32)], 8, 4, 1, DEVICE) for _ in range(2)]
    for pool in pools:
        for t in pool.layer(0).paged.values():
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(1)))
    paged = [pool.layer(0).paged for pool in pools]
    store = (paged[0]["k"].flatten(0, 1), v, paged[0]["v"].flatten(0, 1), slots)
    k = norm_rope(x, weight, 1e-6, cos.to(DEVICE), sin.to(DEVICE), store)
    write_kv(pools[1].layer(0), slots, k, v)
    for name in ("k", "v"):
        assert torch.equal(paged[0][name], paged[1][name]), name
