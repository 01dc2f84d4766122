"""A gated MLP's second half for a few rows (decode): down · (silu(gate) · up) as one Triton kernel.

The shared expert of a MoE block gets its gate and up projections from the block's fused input GEMM
(common/model/fused_linear.py); torch then runs SiLU, the product and cuBLAS's GEMV: three launches a layer
for ~3 MB of weight. Here program (row t, block of outputs) forms silu(gate)·up in registers, a block of
inputs at a time, and multiplies it by its rows of the down weight, in fp32 with one rounding. A program
reads its first block of weights before it waits for the kernel before it (pdl.py): at flashnext's shape
(I 640) its whole tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.kernels.config import KERNELS, KernelConfig
from common.kernels.pdl import gdc_enter, launch

DOWN_ROWS = 16
"""Rows up to which `swiglu_down` runs (each program one row: the weight's tiles come from L2 for the
others); past it, torch's GEMM."""


@triton.jit
def _swiglu_down_kernel(
    gate_ptr, up_ptr, w_ptr, out_ptr, hidden, gate_stride, up_stride,
    INTER: tl.constexpr, BLOCK: tl.constexpr, I_BLOCK: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    swiglu_down_block(
        gate_ptr, up_ptr, w_ptr, out_ptr, hidden, gate_stride, up_stride, tl.program_id(0), tl.program_id(1),
        INTER, BLOCK, I_BLOCK, GDC,
    )  # fmt: skip


@triton.jit
def swiglu_down_block(
    gate_ptr, up_ptr, w_ptr, out_ptr, hidden, gate_stride, up_stride, t, block,
    INTER: tl.constexpr, BLOCK: tl.constexpr, I_BLOCK: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """Row t's outputs [BLOCK·block, BLOCK·(block+1)); waits (gdc_enter) after its first weight tile's
    loads."""
    n = block * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] output columns
    live_n = n < hidden
    rows = w_ptr + n[:, None] * INTER
    r = tl.arange(0, I_BLOCK)
    live_r = r < INTER
    w = tl.load(rows + r[None, :], mask=live_n[:, None] & live_r[None, :], other=0.0)  # [BLOCK, I_BLOCK]
    gdc_enter(GDC)  # the first block's weights (no kernel writes them) were read before the wait
    acc = _swiglu_block(gate_ptr + t * gate_stride, up_ptr + t * up_stride, r, live_r, w)
    for i0 in range(I_BLOCK, INTER, I_BLOCK):
        r = i0 + tl.arange(0, I_BLOCK)
        live_r = r < INTER
        w = tl.load(rows + r[None, :], mask=live_n[:, None] & live_r[None, :], other=0.0)
        acc += _swiglu_block(gate_ptr + t * gate_stride, up_ptr + t * up_stride, r, live_r, w)
    tl.store(out_ptr + t * hidden + n, acc.to(out_ptr.dtype.element_ty), mask=live_n)


@triton.jit
def _swiglu_block(gate_row, up_row, r, live_r, w):
    """w [BLOCK, I_BLOCK] · (silu(gate) · up) at inputs r → [BLOCK] fp32."""
    g = tl.load(gate_row + r, mask=live_r, other=0.0).to(tl.float32)
    u = tl.load(up_row + r, mask=live_r, other=0.0).to(tl.float32)
    a = g / (1.0 + tl.exp(-g)) * u  # [I_BLOCK] silu(gate) · up
    return tl.sum(w.to(tl.float32) * a[None, :], axis=1)


def swiglu_down(
    gate: torch.Tensor,
    up: torch.Tensor,
    weight_down: torch.Tensor,
    block: int = 8,
    i_block: int | None = None,
    kernels: KernelConfig = KERNELS,
) -> torch.Tensor:
    """gate, up [T, I] (rows may be strided: views of a fused projection's output), weight_down [H, I] →
    weight_down · (silu(gate) · up) [T, H] in gate's dtype. `i_block` inputs a step (default: all of I up to
    1,024, so that a shared expert's whole weight tile is read before the kernel waits for the one before)."""
    t, inter = gate.shape
    hidden = weight_down.shape[0]
    assert gate.stride(1) == 1 and up.stride(1) == 1 and weight_down.is_contiguous()
    assert weight_down.shape[1] == inter == up.shape[1]
    i_block = i_block or min(1024, triton.next_power_of_2(inter))
    out = torch.empty((t, hidden), dtype=gate.dtype, device=gate.device)
    _swiglu_down_kernel[(t, triton.cdiv(hidden, block))](
        gate, up, weight_down, out, hidden, gate.stride(0), up.stride(0), INTER=inter, BLOCK=block,
        I_BLOCK=i_block, **launch(gate.device, kernels=kernels),
    )  # fmt: skip
    return out
