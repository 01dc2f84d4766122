"""Hyper-connection elementwise work as three Triton kernels (common/model/qwen4_exp/hyper.py).

A hyper-connection around a sublayer is, in torch, ~30 small kernels: a grouped RMSNorm of the hc streams,
the gate's scale and activations, the gated mean over streams, the injection weights' sigmoid and the
residual update. Its three GEMVs (mix down, mix up, inject) stay cuBLAS calls; the rest is:

- `hc_norm`: streams [T, hc·H] → normed, each stream RMS-normalised on its own, weight (1 + w);
- `hc_mix`: (up [T, hc·H] logits, normed) → Σ_s σ(up_s)·normed_s / hc  [T, H];
- `hc_inject`: (streams, sublayer output [T, H], inject logits [T, hc]) → streams + out ⊗ 2σ(inject / hc).

Everything is computed in fp32 and rounded once to the streams' dtype (torch rounds some intermediate
products to bf16, so results agree to bf16 rounding, not bit for bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_kernel(x_ptr, w_ptr, out_ptr, hidden, eps, BLOCK: tl.constexpr):
    t, s = tl.program_id(0), tl.program_id(1)
    streams = tl.num_programs(1)
    i = tl.arange(0, BLOCK)
    live = i < hidden
    at = (t * streams + s) * hidden + i
    x = tl.load(x_ptr + at, mask=live, other=0.0).to(tl.float32)
    x = x * tl.math.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    w = tl.load(w_ptr + s * hidden + i, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + at, (x * (1.0 + w)).to(out_ptr.dtype.element_ty), mask=live)


@triton.jit
def _mix_kernel(up_ptr, normed_ptr, out_ptr, hidden, HC: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = i < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(HC):
        at = (t * HC + s) * hidden + i
        gate = tl.sigmoid(tl.load(up_ptr + at, mask=live, other=0.0).to(tl.float32))
        acc += gate * tl.load(normed_ptr + at, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * hidden + i, (acc / HC).to(out_ptr.dtype.element_ty), mask=live)


@triton.jit
def _inject_kernel(x_ptr, y_ptr, inject_ptr, out_ptr, hidden, HC: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = i < hidden
    y = tl.load(y_ptr + t * hidden + i, mask=live, other=0.0).to(tl.float32)
    for s in range(HC):
        weight = 2.0 * tl.sigmoid(tl.load(inject_ptr + t * HC + s).to(tl.float32) / HC)
        at = (t * HC + s) * hidden + i
        x = tl.load(x_ptr + at, mask=live, other=0.0).to(tl.float32)
        tl.store(out_ptr + at, (x + y * weight).to(out_ptr.dtype.element_ty), mask=live)


def hc_norm(streams: torch.Tensor, weight: torch.Tensor, eps: float, hc: int) -> torch.Tensor:
    """streams [T, hc·H] → each stream x · rsqrt(mean(x²) + eps) · (1 + w_s), in the streams' dtype."""
    t, width = streams.shape
    hidden = width // hc
    out = torch.empty_like(streams)
    _norm_kernel[(t, hc)](
        streams.contiguous(), weight, out, hidden, eps, BLOCK=triton.next_power_of_2(hidden)
    )
    return out


def hc_mix(up: torch.Tensor, normed: torch.Tensor, hc: int, block: int = 1024) -> torch.Tensor:
    """The sublayer input: mean over streams of σ(up_s) · normed_s, [T, H] in normed's dtype."""
    t, width = normed.shape
    hidden = width // hc
    out = torch.empty((t, hidden), dtype=normed.dtype, device=normed.device)
    _mix_kernel[(t, triton.cdiv(hidden, block))](
        up.contiguous(), normed.contiguous(), out, hidden, HC=hc, BLOCK=block
    )
    return out


def hc_inject(
    streams: torch.Tensor, out: torch.Tensor, inject: torch.Tensor, block: int = 1024
) -> torch.Tensor:
    """streams [T, hc·H] + the sublayer's out [T, H] weighted per stream by 2σ(inject [T, hc] / hc)."""
    t, hc = inject.shape
    hidden = out.shape[1]
    new = torch.empty_like(streams)
    _inject_kernel[(t, triton.cdiv(hidden, block))](
        streams.contiguous(), out.contiguous(), inject.contiguous(), new, hidden, HC=hc, BLOCK=block
    )
    return new
