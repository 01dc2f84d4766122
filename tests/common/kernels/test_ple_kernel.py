"""PLE's decode-step gate kernel against the module's torch ops: the gated value and the conv's input, for
keys and values that are strided views of one projection (as the fused GEMM's), a zero gate included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.model.loader import load_model
from common.model.qwen4_exp.ple import PLE
from common.model.synthetic.checkpoint import make_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_ple_gate_matches_the_torch_ops(tmp_path: Path, dtype: torch.dtype) -> None:
    from common.kernels.ple import ple_gate  # Triton

    path = make_model(tmp_path / "m", preset="tiny", arch="qwen4_exp", overrides={"hidden_size": 80})
    ple = next(m for m in load_model(path, dtype=dtype, device=DEVICE).modules() if isinstance(m, PLE))
    gen = torch.Generator().manual_seed(0)
    for norm in (ple.norm_key, ple.norm_query, ple.norm_conv):
        norm.weight.data = (torch.randn(norm.weight.shape, generator=gen) * 0.2).to(DEVICE, dtype)
    tokens, width, hidden = 3, ple.hc * ple.hidden, ple.hidden
    product = torch.randn(tokens, width + hidden + 8, generator=gen).to(DEVICE, dtype)
    key, value = product[:, :width], product[:, width : width + hidden]  # rows of width + H + 8
    streams = torch.randn(tokens, width, generator=gen).to(DEVICE, dtype)
    streams[1, :hidden] = 0.0  # stream 0 of token 1: a zero gate (σ(0) = 1/2)
    want = ple.gate(key, streams, value)
    norms = (ple.norm_key.weight, ple.norm_query.weight, ple.norm_conv.weight)
    gated, conv_in = ple_gate(key, streams, value, norms, ple.norm_key.eps, ple.hc)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(gated, want, rtol=tol, atol=tol)
    torch.testing.assert_close(conv_in, ple.norm_conv(want), rtol=tol, atol=tol)
