"""The fp8 kernel (common/kernels/fp8_gemv.py) against dequantise-then-multiply, on its own and inside a
qwen4_exp model whose fused projections are fp8 (Triton's interpreter without CUDA)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from common.model.fp8_linear import dequantize_fp8, quantize_fp8
from common.model.synthetic import make_model
from tests.common.model.test_fp8_linear import assert_fp8_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# bf16 dots need the GPU: Triton's interpreter (CPU) has fp32 ones only.
DTYPES = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_kernel_matches_dequantised_linear(rows: int, bias: bool, dtype: torch.dtype) -> None:
    from common.kernels.fp8_gemv import fp8_gemv

    gen = torch.Generator().manual_seed(rows)
    codes, scale = quantize_fp8(torch.randn(200, 300, generator=gen) * 0.05)  # N past the block, K partial
    x = torch.randn(rows, 300, generator=gen)
    b = torch.randn(200, generator=gen) if bias else None
    codes, scale, x = codes.to(DEVICE), scale.to(DEVICE), x.to(DEVICE, dtype)
    b = None if b is None else b.to(DEVICE, dtype)
    want = F.linear(x.float(), dequantize_fp8(codes, scale, torch.float32), None if b is None else b.float())
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: the output's rounding
    torch.testing.assert_close(fp8_gemv(x, codes, scale, b).float(), want, rtol=tol, atol=tol)


def test_fused_fp8_projections_keep_the_model_close(tmp_path: Path) -> None:
    assert_fp8_close(make_model(tmp_path / "q4", preset="tiny", arch="qwen4_exp"), fused=True, device=DEVICE)
