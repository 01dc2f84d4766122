"""y = x · Wᵀ for a few rows of x against an fp8 (e4m3) weight with one scale per row and block of 128
inputs (common/model/fp8_linear.py), as one Triton kernel: each program reads its BN rows of codes once,
converts them to x's dtype in registers and multiplies a 128-input block at a time on the tensor cores
(x padded to 16 rows, the least tl.dot takes), scaling each block's partial product by its rows' scales.

A decode step multiplies one row per lane: the weight's bytes set the time, and fp8 halves them against
bf16. Graph-safe (no host sync, shapes alone fix the launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.model.fp8_linear import BLOCK_K, MAX_ROWS


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, m, n, k,
    BLOCKS: tl.constexpr, M_PAD: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BN + tl.arange(0, BN)  # [BN] output features
    live_n = rows < n
    r = tl.arange(0, M_PAD)
    live_m = r < m
    acc = tl.zeros((M_PAD, BN), dtype=tl.float32)
    for kb in range(BLOCKS):
        cols = kb * BK + tl.arange(0, BK)
        live_k = cols < k
        x = tl.load(x_ptr + r[:, None] * k + cols[None, :], mask=live_m[:, None] & live_k[None, :], other=0.0)
        at = rows[:, None].to(tl.int64) * k + cols[None, :]
        w = tl.load(q_ptr + at, mask=live_n[:, None] & live_k[None, :], other=0.0)  # [BN, BK] e4m3
        part = tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)  # [M_PAD, BN]
        scale = tl.load(s_ptr + rows.to(tl.int64) * BLOCKS + kb, mask=live_n, other=0.0)
        acc += part * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=live_n, other=0.0).to(tl.float32)[None, :]
    out = r[:, None] * n + rows[None, :]
    tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=live_m[:, None] & live_n[None, :])


def fp8_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    bn: int = 64,
) -> torch.Tensor:
    """x [M ≤ 16, K] · (qweight [N, K] e4m3 × scale [N, ⌈K/128⌉] fp32)ᵀ (+ bias [N]) → [M, N] in x's dtype."""
    m, k = x.shape
    n = qweight.shape[0]
    assert m <= MAX_ROWS, f"{m} rows: at most {MAX_ROWS} (larger batches dequantise and run a GEMM)"
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _fp8_gemv_kernel[(triton.cdiv(n, bn),)](
        x.contiguous(), qweight, scale, bias if bias is not None else scale, y, m, n, k,
        BLOCKS=scale.shape[1], M_PAD=MAX_ROWS, BN=bn, BK=BLOCK_K, HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32: full IEEE, as torch without tf32
    )  # fmt: skip
    return y
