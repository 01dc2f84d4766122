"""Hyper-connection elementwise work as three Triton kernels (common/model/qwen4_exp/hyper.py).

A hyper-connection around a sublayer is, in torch, ~30 small kernels: a grouped RMSNorm of the hc streams,
the gate's scale and activations, the gated mean over streams, the injection weights' sigmoid and the
residual update. Its three GEMVs (mix down, mix up, inject) stay cuBLAS calls; the rest is:

- `hc_norm`: streams [T, hc·H] → normed, each stream RMS-normalised on its own, weight (1 + w);
- `hc_mix`: (up [T, hc·H] logits, normed) → Σ_s σ(up_s)·normed_s / hc  [T, H];
- `hc_inject`: (streams, sublayer output [T, H], inject logits [T, hc]) → streams + out ⊗ 2σ(inject / hc).
- `hc_mix_up`, for a few rows (decode): `hc_mix` with the mix-up GEMV inside, from the mix-down output:
  up = W_up · silu(down / hc) computed per stream in registers. In a decode step that is one kernel where
  there were four (the division, the SiLU, cuBLAS's GEMV, hc_mix: ~9 µs a sublayer on an H200, 96
  sublayers a step); the weight (hc·H × rank, 6.5 MB for flashnext) is read once, up never written.
- `hc_project`, for a few rows: the mix-down and inject projection from the raw streams, normalised as they
  are read (hc_norm and the GEMV in one kernel), with the streams' scales for hc_mix_up.

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


@triton.jit
def _mix_up_kernel(
    down_ptr, w_ptr, x_ptr, scale_ptr, nw_ptr, out_ptr, hidden, rank, down_stride,
    HC: tl.constexpr, BLOCK: tl.constexpr, R_PAD: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] hidden columns
    live = i < hidden
    r = tl.arange(0, R_PAD)
    live_r = r < rank
    tile = live[:, None] & live_r[None, :]
    d = tl.load(down_ptr + t * down_stride + r, mask=live_r, other=0.0).to(tl.float32) / HC
    d = d / (1.0 + tl.exp(-d))  # [R_PAD] silu(down / hc)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(HC):
        rows = s * hidden + i  # stream s's rows of W_up
        w = tl.load(w_ptr + rows[:, None] * rank + r[None, :], mask=tile, other=0.0)  # [BLOCK, R_PAD]
        gate = tl.sigmoid(tl.sum(w.to(tl.float32) * d[None, :], axis=1))  # [BLOCK] σ(up_s)
        x = tl.load(x_ptr + (t * HC + s) * hidden + i, mask=live, other=0.0).to(tl.float32)
        if NORM:  # x is the raw stream: its norm here, from the scale hc_project wrote
            nw = tl.load(nw_ptr + rows, mask=live, other=0.0).to(tl.float32)
            x = x * tl.load(scale_ptr + t * HC + s) * (1.0 + nw)
        acc += gate * x
    tl.store(out_ptr + t * hidden + i, (acc / HC).to(out_ptr.dtype.element_ty), mask=live)


MIX_UP_ROWS = 16
"""Rows up to which `hc_mix_up` runs (each program multiplies one row: the weight's tiles come from L2 for the
others); past it, a GEMM for up and then `hc_mix`."""


def hc_mix_up(
    down: torch.Tensor,
    weight_up: torch.Tensor,
    x: torch.Tensor,
    hc: int,
    block: int = 16,
    scales: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """down [T, R] (rows may be strided: a view of a fused projection's output), weight_up [hc·H, R], x the
    normalised streams [T, hc·H] → Σ_s σ((W_up · silu(down / hc))_s) · x_s / hc, [T, H] in x's dtype. With
    `scales` [T, hc] (hc_project's) and the norm's `norm_weight` [hc·H], x is the raw streams, normalised
    here as hc_norm would (x · scale · (1 + w))."""
    t, rank = down.shape
    hidden = x.shape[1] // hc
    assert down.stride(1) == 1 and weight_up.is_contiguous() and weight_up.shape == (hc * hidden, rank)
    norm = scales is not None
    out = torch.empty((t, hidden), dtype=x.dtype, device=x.device)
    _mix_up_kernel[(t, triton.cdiv(hidden, block))](
        down, weight_up, x.contiguous(), scales if norm else x, norm_weight if norm else x, out, hidden, rank,
        down.stride(0), HC=hc, BLOCK=block, R_PAD=triton.next_power_of_2(rank), NORM=norm,
    )  # fmt: skip
    return out


@triton.jit
def _project_kernel(
    x_ptr, nw_ptr, w_ptr, out_ptr, scale_ptr, n_out, eps,
    HC: tl.constexpr, H: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    t, nb = tl.program_id(0), tl.program_id(1)
    n = nb * BN + tl.arange(0, BN)  # [BN] output columns
    live_n = n < n_out
    k = tl.arange(0, BK)
    row = x_ptr + t * HC * H
    acc = tl.zeros((BN,), dtype=tl.float32)
    for s in range(HC):
        squares = tl.zeros((BK,), dtype=tl.float32)
        for k0 in range(0, H, BK):  # stream s's mean square (every program: ~20 KB from L2 a row)
            xs = tl.load(row + s * H + k0 + k, mask=k0 + k < H, other=0.0).to(tl.float32)
            squares += xs * xs
        scale = tl.math.rsqrt(tl.sum(squares, axis=0) / H + eps)
        tl.store(scale_ptr + t * HC + s, scale, mask=nb == 0)
        for k0 in range(0, H, BK):
            live_k = k0 + k < H
            col = s * H + k0 + k
            xs = tl.load(row + col, mask=live_k, other=0.0).to(tl.float32)
            xs = xs * scale * (1.0 + tl.load(nw_ptr + col, mask=live_k, other=0.0).to(tl.float32))
            tile = live_n[:, None] & live_k[None, :]
            w = tl.load(w_ptr + n[:, None] * (HC * H) + col[None, :], mask=tile, other=0.0)  # [BN, BK]
            acc += tl.sum(w.to(tl.float32) * xs[None, :], axis=1)
    tl.store(out_ptr + t * n_out + n, acc.to(out_ptr.dtype.element_ty), mask=live_n)


def hc_project(
    streams: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, hc: int,
    block_n: int = 4, block_k: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A few rows' hyper-connection input projection from the raw streams [T, hc·H]: hc_norm's normalised
    streams (weight (1 + norm_weight)) times weight [N, hc·H]ᵀ → (the product [T, N] in the streams'
    dtype, each stream's scale rsqrt(mean(x²) + eps) [T, hc] fp32, for hc_mix_up). The norm is applied as
    the streams are read: no normalised copy, one launch where a decode step ran hc_norm, cuBLAS's
    split-K GEMV and its reduction (~13 µs a sublayer, 96 a step, in the all-fit profile)."""
    t, width = streams.shape
    n_out = weight.shape[0]
    assert weight.is_contiguous() and weight.shape[1] == width and width % hc == 0
    out = torch.empty((t, n_out), dtype=streams.dtype, device=streams.device)
    scales = torch.empty((t, hc), dtype=torch.float32, device=streams.device)
    _project_kernel[(t, triton.cdiv(n_out, block_n))](
        streams.contiguous(), norm_weight, weight, out, scales, n_out, eps, HC=hc, H=width // hc, BN=block_n,
        BK=block_k,
    )  # fmt: skip
    return out, scales


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
