"""A gated MLP's second half for a few rows (decode): down · (silu(gate) · up) as one Triton kernel.

The shared expert of a MoE block gets its gate and up projections from the block's fused input GEMM
(common/model/fused_linear.py); torch then runs SiLU, the product and cuBLAS's GEMV: three launches a layer
for ~3 MB of weight. Here program (row t, block of outputs) forms silu(gate)·up in registers, a block of
inputs at a time, and multiplies it by its rows of the down weight, in fp32 with one rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.kernels.pdl import gdc_enter, launch

DOWN_ROWS = 16
"""Rows up to which `swiglu_down` runs (each program one row: the weight's tiles come from L2 for the
others); past it, torch's GEMM."""


@triton.jit
def _swiglu_down_kernel(
    gate_ptr, up_ptr, w_ptr, out_ptr, hidden, gate_stride, up_stride,
    INTER: tl.constexpr, BLOCK: tl.constexpr, I_BLOCK: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(GDC)
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] output columns
    live_n = n < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i0 in range(0, INTER, I_BLOCK):
        r = i0 + tl.arange(0, I_BLOCK)
        live_r = r < INTER
        g = tl.load(gate_ptr + t * gate_stride + r, mask=live_r, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + t * up_stride + r, mask=live_r, other=0.0).to(tl.float32)
        a = g / (1.0 + tl.exp(-g)) * u  # [I_BLOCK] silu(gate) · up
        tile = live_n[:, None] & live_r[None, :]
        w = tl.load(w_ptr + n[:, None] * INTER + r[None, :], mask=tile, other=0.0)  # [BLOCK, I_BLOCK]
        acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
    tl.store(out_ptr + t * hidden + n, acc.to(out_ptr.dtype.element_ty), mask=live_n)


def swiglu_down(
    gate: torch.Tensor, up: torch.Tensor, weight_down: torch.Tensor, block: int = 16, i_block: int = 256
) -> torch.Tensor:
    """gate, up [T, I] (rows may be strided: views of a fused projection's output), weight_down [H, I] →
    weight_down · (silu(gate) · up) [T, H] in gate's dtype."""
    t, inter = gate.shape
    hidden = weight_down.shape[0]
    assert gate.stride(1) == 1 and up.stride(1) == 1 and weight_down.is_contiguous()
    assert weight_down.shape[1] == inter == up.shape[1]
    out = torch.empty((t, hidden), dtype=gate.dtype, device=gate.device)
    _swiglu_down_kernel[(t, triton.cdiv(hidden, block))](
        gate, up, weight_down, out, hidden, gate.stride(0), up.stride(0), INTER=inter, BLOCK=block,
        I_BLOCK=i_block, **launch(gate.device),
    )  # fmt: skip
    return out
