"""The gated output norm kernel against GatedRMSNorm (SiLU gate)."""

from __future__ import annotations

import torch

from common.model.qwen4_exp.norms import GatedRMSNorm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_gated_norm_matches_module() -> None:
    from common.kernels.gated_norm import gated_rms_norm

    gen = torch.Generator().manual_seed(0)
    tokens, heads, dim = 3, 4, 48  # dim not a power of two: masked tail
    norm = GatedRMSNorm(dim, 1e-6, "silu")
    norm.weight.data = torch.randn(dim, generator=gen)
    x, gate = torch.randn(tokens, heads, dim, generator=gen), torch.randn(tokens, heads, dim, generator=gen)
    want = norm(x, gate).reshape(tokens, -1)
    got = gated_rms_norm(x.to(DEVICE), gate.to(DEVICE), norm.weight.to(DEVICE), norm.eps, torch.float32)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def test_gated_norm_reads_a_strided_gate() -> None:
    """The gate as GatedDeltaNet's prefill hands it over: columns of a wider projection output."""
    from common.kernels.gated_norm import gated_rms_norm

    gen = torch.Generator().manual_seed(1)
    tokens, heads, dim = 5, 3, 32
    norm = GatedRMSNorm(dim, 1e-6, "silu")
    norm.weight.data = torch.randn(dim, generator=gen)
    x = torch.randn(tokens, heads, dim, generator=gen)
    wide = torch.randn(tokens, heads * dim + 40, generator=gen)
    gate = wide[:, 8 : 8 + heads * dim]
    want = norm(x, gate.reshape(tokens, heads, dim)).reshape(tokens, -1)
    got = gated_rms_norm(x.to(DEVICE), gate.to(DEVICE), norm.weight.to(DEVICE), norm.eps, torch.float32)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
