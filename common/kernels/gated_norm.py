"""GatedDeltaNet's output norm (common/model/qwen4_exp/norms.py `GatedRMSNorm`) as one Triton kernel:
weight · RMSNorm(x) · act(gate) per head, from the recurrence's fp32 output straight to the model dtype.

In torch it is ~10 kernels (casts, square, mean, rsqrt, products, the gate's activation). Program (token,
head) normalises one head's Dv values in fp32 and rounds once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.kernels.config import KERNELS, KernelConfig
from common.kernels.pdl import gdc_enter, launch

ACTIVATIONS = ("silu", "swish")
"""Gate activations the kernel computes (SiLU: what qwen4_exp uses); others stay on the torch path."""


@triton.jit
def _gated_norm_kernel(
    x_ptr, gate_ptr, w_ptr, out_ptr, dim, heads, gate_stride, eps, BLOCK: tl.constexpr, GDC: tl.constexpr
):
    gdc_enter(GDC)
    row = tl.program_id(0).to(tl.int64)  # (token, head) flattened (T·H·D may pass 2³¹)
    i = tl.arange(0, BLOCK)
    live = i < dim
    x = tl.load(x_ptr + row * dim + i, mask=live, other=0.0).to(tl.float32)
    x = x * tl.math.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    at = (row // heads) * gate_stride + (row % heads) * dim  # the gate's rows may be strided (a split view)
    gate = tl.load(gate_ptr + at + i, mask=live, other=0.0).to(tl.float32)
    gate = gate / (1.0 + tl.exp(-gate))  # SiLU
    w = tl.load(w_ptr + i, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * dim + i, (w * x * gate).to(out_ptr.dtype.element_ty), mask=live)


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    dtype: torch.dtype,
    kernels: KernelConfig = KERNELS,
) -> torch.Tensor:
    """x [T, H, D] (any float dtype), gate [T, H·D] (its rows may be strided: a view of a fused projection's
    output) or [T, H, D], weight [D] → weight · RMSNorm(x) · SiLU(gate) [T, H·D] in `dtype`."""
    t, heads, dim = x.shape
    gate = gate.reshape(t, heads * dim)
    if gate.stride(1) != 1:
        gate = gate.contiguous()
    out = torch.empty((t, heads * dim), dtype=dtype, device=x.device)
    # trigger_first (KernelConfig.pdl_start_trigger): the next kernel is the output projection
    _gated_norm_kernel[(t * heads,)](
        x.contiguous(), gate, weight, out, dim, heads, gate.stride(0), eps,
        BLOCK=triton.next_power_of_2(dim), **launch(x.device, trigger_first=True, kernels=kernels),
    )  # fmt: skip
    return out
