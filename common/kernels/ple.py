"""PLE's gate on a decode step (common/model/qwen4_exp/ple.py) as one Triton kernel.

From the n-gram key [T, hc·H] and value [T, H] (PLE's projections of the gathered rows) and the streams
[T, hc·H], each stream s gets gated_s = σ(g_s) · value with g_s = signed √|⟨norm_k(key_s), norm_q(x_s)⟩ / √H|,
and the conv's input norm_c(gated_s). In torch that is three norm kernels and ~10 elementwise ones on a few
thousand values; here program (token, stream) does it in registers. Each intermediate is rounded to the
model's dtype where torch's op rounds it, so only the dot's summation order differs from torch's.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from common.kernels.config import KERNELS, KernelConfig
from common.kernels.pdl import gdc_enter, launch


@triton.jit
def _rms(x, w, live, hidden, eps):
    """OffsetRMSNorm of one stream: x · rsqrt(mean(x²) + eps) · (1 + w), fp32."""
    x = tl.where(live, x, 0.0)
    return x * tl.math.rsqrt(tl.sum(x * x, axis=0) / hidden + eps) * (1.0 + w)


@triton.jit
def _ple_gate_kernel(
    key_ptr, key_stride, x_ptr, value_ptr, value_stride, wk_ptr, wq_ptr, wc_ptr, gated_ptr, conv_ptr,
    hidden, eps, sqrt_hidden, HC: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(GDC)
    t, s = tl.program_id(0), tl.program_id(1)
    dtype = gated_ptr.dtype.element_ty
    i = tl.arange(0, BLOCK)
    live = i < hidden
    col = s * hidden + i
    key = tl.load(key_ptr + t * key_stride + col, mask=live, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + t * HC * hidden + col, mask=live, other=0.0).to(tl.float32)
    wk = tl.load(wk_ptr + col, mask=live, other=0.0).to(tl.float32)
    wq = tl.load(wq_ptr + col, mask=live, other=0.0).to(tl.float32)
    key = _rms(key, wk, live, hidden, eps).to(dtype).to(tl.float32)
    query = _rms(x, wq, live, hidden, eps).to(dtype).to(tl.float32)
    g = tl.sum(tl.where(live, (key * query).to(dtype).to(tl.float32), 0.0), axis=0).to(dtype)
    g = (g.to(tl.float32) / sqrt_hidden).to(dtype).to(tl.float32)
    root = tl.sqrt(tl.maximum(tl.abs(g), 1e-6).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    g = tl.where(g > 0, root, tl.where(g < 0, -root, 0.0))
    sig = (1.0 / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    value = tl.load(value_ptr + t * value_stride + i, mask=live, other=0.0).to(tl.float32)
    gated = (sig * value).to(dtype)
    tl.store(gated_ptr + t * HC * hidden + col, gated, mask=live)
    wc = tl.load(wc_ptr + col, mask=live, other=0.0).to(tl.float32)
    conv_in = _rms(gated.to(tl.float32), wc, live, hidden, eps)
    tl.store(conv_ptr + t * HC * hidden + col, conv_in.to(dtype), mask=live)


def ple_gate(
    key: torch.Tensor,
    streams: torch.Tensor,
    value: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    eps: float,
    hc: int,
    kernels: KernelConfig = KERNELS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """key [T, hc·H] and value [T, H] (rows may be strided: views of one projection's output, the last
    dim's 1), streams [T, hc·H], the key, query and conv norms' weights [hc·H] → (gated, the conv's input),
    [T, hc·H] each in the streams' dtype."""
    t, width = streams.shape
    hidden = width // hc
    assert key.shape == (t, width) and value.shape == (t, hidden) and key.stride(1) == value.stride(1) == 1
    streams = streams.contiguous()
    gated, conv_in = torch.empty_like(streams), torch.empty_like(streams)  # contiguous, as streams now
    wk, wq, wc = norms
    _ple_gate_kernel[(t, hc)](
        key, key.stride(0), streams, value, value.stride(0), wk, wq, wc, gated, conv_in,
        hidden, eps, math.sqrt(hidden), HC=hc, BLOCK=triton.next_power_of_2(hidden), num_warps=8,
        **launch(streams.device, kernels=kernels),
    )  # fmt: skip
    return gated, conv_in
