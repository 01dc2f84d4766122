"""Norm + RoPE in one kernel against OffsetRMSNorm then apply_rotary: partial rotary, a strided input (a
view of a wider projection, as QSA's q is), heads of 32 and 64, the cos/sin computed in the kernel; the
key's and value's page writes."""

from __future__ import annotations

import pytest
import torch

from common.config import RopeConfig
from common.model.qwen4_exp.norms import OffsetRMSNorm
from common.model.rope import RotaryEmbedding, apply_rotary

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("dim", "rot"), [(32, 16), (64, 64)])
def test_norm_rope_matches_torch(dim: int, rot: int) -> None:
    """The kernel's own cos/sin (yarn-scaled, at positions far apart) as the rotary's cos_sin."""
    from common.kernels.norm_rope import norm_rope

    gen = torch.Generator().manual_seed(dim)
    tokens, heads = 3, 4
    norm = OffsetRMSNorm(dim, 1e-6)
    norm.weight.data = torch.randn(dim, generator=gen) * 0.1
    wide = torch.randn(tokens, heads, 2 * dim, generator=gen)
    x = wide[..., :dim]  # strided, as a chunk of q_proj's output
    rope = RopeConfig(theta=10_000.0, rope_type="yarn", factor=4.0, original_max_position=4096)
    rotary = RotaryEmbedding(rope, rot, 16_384)
    positions = torch.tensor([0, 37, 12_345])
    want = apply_rotary(norm(x), *rotary.cos_sin(positions, x.dtype))
    on = lambda t: t.to(DEVICE)
    got = norm_rope(on(wide)[..., :dim], on(norm.weight.data), norm.eps, on(positions), rotary.to(DEVICE))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def test_norm_rope_stores_the_key_and_value_as_write_kv() -> None:
    """With `store`: the rotated keys and the values (a strided view, as QSA's v of its fused projection)
    land in their pages at the tokens' slots, bit for bit what write_kv writes; the other slots untouched."""
    from common.kernels.norm_rope import norm_rope
    from common.kv.backend import kv_specs, kv_store, write_kv
    from common.kv.state import StatePool

    gen = torch.Generator().manual_seed(5)
    tokens, heads, dim = 3, 2, 32
    x = torch.randn(tokens, heads, dim, generator=gen).to(DEVICE)
    fused = torch.randn(tokens, heads * dim * 3, generator=gen).to(DEVICE)
    v = fused[:, heads * dim : 2 * heads * dim].view(tokens, heads, dim)  # rows of 3·H·D
    weight, positions = torch.zeros(dim, device=DEVICE), torch.tensor([5, 0, 17], device=DEVICE)
    rotary = RotaryEmbedding(RopeConfig(theta=10_000.0), 16, 64).to(DEVICE)
    slots = torch.tensor([9, 2, 30], device=DEVICE)
    pools = [StatePool([kv_specs(heads, dim, torch.float32)], 8, 4, 1, DEVICE) for _ in range(2)]
    for pool in pools:
        for t in pool.layer(0).paged.values():
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(1)))
    paged = [pool.layer(0).paged for pool in pools]
    store = kv_store(pools[0].layer(0), slots, v)
    k = norm_rope(x, weight, 1e-6, positions, rotary, store)
    write_kv(pools[1].layer(0), slots, k, v)
    for name in ("k", "v"):
        assert torch.equal(paged[0][name], paged[1][name]), name
