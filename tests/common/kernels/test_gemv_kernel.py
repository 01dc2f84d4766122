"""The GEMV kernel (common/kernels/gemv.py) against F.linear, for plain and fp8 weights (dequantised), rows
on the CUDA cores and on the tensor cores, and inside a qwen4_exp model whose fused projections are fp8
(Triton's interpreter without CUDA)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from common.kernels.config import KERNELS
from common.kernels.gemv import FP8_LARGE_ONE_ROW, GemvConfig, gemv, scale_blocks
from common.model.fp8_linear import dequantize_fp8, quantize_fp8
from common.model.synthetic.checkpoint import make_model
from tests.common.model.test_fp8_linear import assert_fp8_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# bf16 dots need the GPU: Triton's interpreter (CPU) has fp32 ones only.
DTYPES = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # bf16: the output's rounding


def _inputs(rows: int, bias: bool, dtype: torch.dtype, k: int = 300) -> tuple:
    """x [rows, k], a weight [200, k] (N past a block, K past one unless a multiple), a bias or None."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(200, k, generator=gen) * 0.05
    x = torch.randn(rows, k, generator=gen)
    b = torch.randn(200, generator=gen) if bias else None
    return x.to(DEVICE, dtype), w, None if b is None else b.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_weight_matches_dequantised_linear(rows: int, bias: bool, dtype: torch.dtype) -> None:
    x, w, b = _inputs(rows, bias, dtype)
    codes, scale = (t.to(DEVICE) for t in quantize_fp8(w))
    want = F.linear(x.float(), dequantize_fp8(codes, scale, torch.float32), None if b is None else b.float())
    # one scale block a step (on the tensor cores or the CUDA cores), or several scaled in registers, K past
    # the last step's blocks
    configs = (
        None,
        GemvConfig(bn=16, bk=128, splits=2, dot_rows=3),
        GemvConfig(bn=32, bk=256),
        GemvConfig(bn=64, bk=512, splits=2, dot_rows=3),
        FP8_LARGE_ONE_ROW,
    )
    for cfg in configs:
        got = gemv(x, codes, b, scale, config=cfg).float()
        torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype])
    assert not scale_blocks(GemvConfig(bk=192))
    with pytest.raises(AssertionError, match="whole scale blocks"):
        gemv(x, codes, b, scale, config=GemvConfig(bk=64))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("rows", [1, 2, 3, 16])
@pytest.mark.parametrize("k", [300, 512])
def test_plain_weight_matches_linear(rows: int, k: int, dtype: torch.dtype) -> None:
    x, w, b = _inputs(rows, True, dtype, k)
    w = w.to(DEVICE, dtype)
    want = F.linear(x.float(), w.float(), b.float())
    configs = (  # one chunk or several (summed by the second kernel), CUDA cores or tensor cores
        GemvConfig(),
        GemvConfig(bn=32, bk=128, dot_rows=3, splits=2),
        GemvConfig(bn=64, bk=64, dot_rows=16, splits=3),
    )
    for cfg in configs:
        torch.testing.assert_close(gemv(x, w, b, config=cfg).float(), want, rtol=TOL[dtype], atol=TOL[dtype])


def test_no_rows_and_short_inputs() -> None:
    """No rows give an empty product; K below a tensor-core dot's 16 still runs at `choose`'s shape."""
    from common.kernels.gemv import choose

    w = torch.randn(24, 40, device=DEVICE)
    assert gemv(torch.empty(0, 40, device=DEVICE), w).shape == (0, 24)
    short = torch.randn(24, 8, device=DEVICE)
    x = torch.randn(4, 8, device=DEVICE)
    cfg = choose(4, 24, 8, x.device)
    assert cfg.bk >= 16
    torch.testing.assert_close(gemv(x, short, config=cfg), F.linear(x, short), rtol=1e-4, atol=1e-4)


def test_choose_leaves_large_weights_to_cublas_from_two_rows_and_fills_the_sms(monkeypatch) -> None:
    from common.kernels import gemv as module
    from common.kernels.gemv import CUBLAS_ROWS, SCALE_BLOCK, choose, chunks

    cpu = torch.device("cpu")
    assert choose(2, CUBLAS_ROWS, 2560, cpu) is None
    assert choose(1, CUBLAS_ROWS, 2560, cpu).splits == 1  # one row: one chunk a program, no sums' kernel
    assert choose(1, CUBLAS_ROWS, 2560, cpu, kernels=replace(KERNELS, large_one_row=False)) is None
    assert choose(2, CUBLAS_ROWS, 2560, cpu, fp8=True) is not None  # no cuBLAS for fp8 codes
    assert choose(1, CUBLAS_ROWS, 2560, cpu, fp8=True) == module.FP8_LARGE_ONE_ROW  # the wide launch
    narrow = choose(1, CUBLAS_ROWS, 2560, cpu, fp8=True, kernels=replace(KERNELS, fp8_large_one_row=False))
    assert narrow.bk % SCALE_BLOCK == 0  # whole scale blocks a step
    small = choose(1, 1800, 2560, cpu)  # flashnext's MoE input projection: 113 row tiles alone
    assert small.splits > 1 and small.bk * small.splits >= 2560
    assert chunks(2560, small.bk, small.splits)[0] == small.bk and small.stages == 1  # one step, no pipeline
    eight = choose(8, 1800, 2560, cpu)  # from two rows on, at least two steps a chunk
    assert chunks(2560, eight.bk, eight.splits)[0] >= 2 * eight.bk and eight.stages == 2


def test_fused_fp8_projections_keep_the_model_close(tmp_path: Path) -> None:
    assert_fp8_close(make_model(tmp_path / "q4", preset="tiny", arch="qwen4_exp"), fused=True, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("bn", [16, 32])
def test_conv_epilogue_matches_gemv_then_conv_step(bn: int, dtype: torch.dtype) -> None:
    """The first 120 of 200 outputs convolved in the GEMV's epilogue (a row tile across the boundary at
    bn 16 and 32), the rest raw: as the plain GEMV followed by conv_step, the slot's history shifted the
    same and the other slots untouched."""
    from common.kernels.causal_conv import conv_step
    from common.kernels.gemv import ConvStep

    x, w, _ = _inputs(1, False, dtype)
    w = w.to(DEVICE, dtype)
    gen = torch.Generator().manual_seed(7)
    channels, taps = 120, 4
    history = torch.randn(3, channels, taps - 1, generator=gen).to(DEVICE, dtype)
    conv_w = torch.randn(channels, taps, generator=gen).to(DEVICE, dtype)
    slots = torch.tensor([2], device=DEVICE)
    cfg = GemvConfig(bn=bn, bk=128)

    before, want_history = history.clone(), history.clone()
    raw = gemv(x, w, config=cfg)
    want = torch.cat(
        [conv_step(raw[:, :channels], want_history, slots, conv_w, silu=True), raw[:, channels:]], 1
    )
    got = gemv(x, w, config=cfg, conv=ConvStep(history, slots, conv_w))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(history, want_history)
    assert torch.equal(history[:2], before[:2]) and torch.equal(history[2, :, :-1], before[2, :, 1:])
    assert torch.equal(history[2, :, -1], raw[0, :channels])  # the raw outputs appended
