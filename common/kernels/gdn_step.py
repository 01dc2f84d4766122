"""Gated DeltaNet's decode step after its input projection as one Triton kernel: the causal conv + SiLU of q,
k and v (causal_conv.py `conv_step`), the gated delta rule (gated_delta.py) and the gated RMSNorm
(gated_norm.py), where a step otherwise runs the three kernels one after another (36 layers a flashnext step:
~0.28 ms of the serialized all-fit step, decode-allfit-serial-profile.txt, most of it launch, ramp and tail).

Program (token t, value head h, block of BV value columns), as gated_delta.py's, convolves the channels it
reads: its key head's q and k (shared by the head's `group` value heads and their blocks) and its own v
columns. Two steps need every program of a group done first; the last program to arrive does them
(arrival.py):

- the conv history of q's and k's channels is shifted only once every program of the key head has read it:
  the last of them writes it (each program's v history is its own, shifted at once);
- the norm needs the whole head: each block writes its output columns (fp32) and the head's last block
  normalises the row, gates it with SiLU(z) and writes it in the output dtype.

Each intermediate is rounded where the three kernels round it (the conv's output to the projection's dtype),
so the result is theirs up to the order of fp32 sums. Graph-safe: fixed launch shapes, no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.kernels import arrival
from common.kernels.arrival import arrive
from common.kernels.gated_delta import delta_rule, gates, state_block, state_dims
from common.kernels.pdl import gdc_enter, launch


@triton.jit
def _conv(x_row, hist_ptr, slot, w_ptr, c, channels, TAPS: tl.constexpr, BW: tl.constexpr):
    """SiLU(causal conv) of channels c [N] at this token, rounded to x's dtype → (out fp32 [N], the new
    input x [N] in x's dtype, history rows [N, BW] of the slot)."""
    width: tl.constexpr = TAPS - 1
    i = tl.arange(0, BW)
    rows = hist_ptr + (slot * channels + c[:, None]) * width + i[None, :]  # [N, BW]
    hist = tl.load(rows, mask=i[None, :] < width, other=0.0).to(tl.float32)
    x = tl.load(x_row + c)
    acc = tl.zeros(c.shape, dtype=tl.float32)
    for j in tl.static_range(width):  # the taps in conv_step's order: the history's, then the new input
        tap = tl.sum(tl.where(i[None, :] == j, hist, 0.0), axis=1)
        acc += tap * tl.load(w_ptr + c * TAPS + j).to(tl.float32)
    acc += x.to(tl.float32) * tl.load(w_ptr + c * TAPS + width).to(tl.float32)
    acc = acc / (1.0 + tl.exp(-acc))
    return acc.to(x_row.dtype.element_ty).to(tl.float32), x, rows


@triton.jit
def _shift(rows, x, hist_ptr, TAPS: tl.constexpr, BW: tl.constexpr):
    """History rows [N, BW] ← their last TAPS − 2 entries, then x [N] (entry i takes entry i + 1)."""
    width: tl.constexpr = TAPS - 1
    i = tl.arange(0, BW)
    shifted = tl.load(rows + 1, mask=i[None, :] < width - 1, other=0.0)
    shifted = tl.where(i[None, :] == width - 1, x[:, None].to(shifted.dtype), shifted)
    tl.debug_barrier()  # the rows' loads (this program's threads) before their stores
    tl.store(rows, shifted.to(hist_ptr.dtype.element_ty), mask=i[None, :] < width)


@triton.jit
def _gdn_step_kernel(
    x_ptr, hist_ptr, cw_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, slots_ptr, z_ptr, nw_ptr,
    o_ptr, out_ptr, count_ptr, x_stride, a_stride, b_stride, z_stride, heads_v, heads_k, group, key_dim,
    channels, eps,
    DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, TAPS: tl.constexpr, BW: tl.constexpr,
    GDC: tl.constexpr,
):  # fmt: skip
    t, h = tl.program_id(0), tl.program_id(1)
    # Before the wait (pdl.py): the slot and this head's state block, this kernel's own a step ago.
    at, s, cols, slot = state_block(state_ptr, slots_ptr, heads_v, DK, DV, BV)
    gdc_enter(GDC)  # the projections (x, a, b, z): the kernel just before
    g, beta = gates(a_ptr + t * a_stride + h, b_ptr + t * b_stride + h, a_log_ptr + h, dt_bias_ptr + h)
    row = x_ptr + t * x_stride
    kh, d = h // group, tl.arange(0, DK)
    q, xq, q_rows = _conv(row, hist_ptr, slot, cw_ptr, kh * DK + d, channels, TAPS, BW)
    k, xk, k_rows = _conv(row, hist_ptr, slot, cw_ptr, key_dim + kh * DK + d, channels, TAPS, BW)
    v, xv, v_rows = _conv(row, hist_ptr, slot, cw_ptr, 2 * key_dim + h * DV + cols, channels, TAPS, BW)
    _shift(v_rows, xv, hist_ptr, TAPS, BW)
    blocks = tl.num_programs(2)
    if arrive(count_ptr + t * heads_k + kh, group * blocks):  # every reader of q's and k's history is done
        _shift(q_rows, xq, hist_ptr, TAPS, BW)
        _shift(k_rows, xk, hist_ptr, TAPS, BW)
    o = delta_rule(at, s, q, k, v, g, beta, DK)  # gated_delta.py's
    head = (t * heads_v + h) * DV
    tl.store(o_ptr + head + cols, o)
    if arrive(count_ptr + tl.num_programs(0) * heads_k + t * heads_v + h, blocks):  # the head's last block
        j = tl.arange(0, DV)
        row_o = tl.load(o_ptr + head + j, cache_modifier=".cg")  # [DV] the head's outputs
        row_o = row_o * tl.math.rsqrt(tl.sum(row_o * row_o, axis=0) / DV + eps)
        gate = tl.load(z_ptr + t * z_stride + h * DV + j).to(tl.float32)
        gate = gate / (1.0 + tl.exp(-gate))  # SiLU
        w = tl.load(nw_ptr + j).to(tl.float32)
        tl.store(out_ptr + t * heads_v * DV + h * DV + j, (w * row_o * gate).to(out_ptr.dtype.element_ty))


def gdn_step(
    qkv: torch.Tensor,
    history: torch.Tensor,
    conv_weight: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    heads_k: int,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    dtype: torch.dtype,
    block_v: int = 32,
) -> torch.Tensor:
    """One token per sequence: qkv [T, 2·Hk·Dk + Hv·Dv] (the projection, before the conv; rows may be
    strided), history [S, C, K − 1] and conv_weight [C, K] (the conv's, sequence t's history at slots[t],
    shifted in place), a, b [T, Hv] (gate projections, rows may be strided), a_log, dt_bias [Hv], state
    [S, Hv, Dk, Dv] fp32 (updated in place), z [T, Hv·Dv] (the norm's gate, rows may be strided),
    norm_weight [Dv] → weight · RMSNorm(o) · SiLU(z) [T, Hv·Dv] in `dtype`, o the recurrence's output."""
    t, channels = qkv.shape
    heads_v, dk, dv = state_dims(state)
    taps = conv_weight.shape[1]
    block_v = min(block_v, dv)
    if history.shape[1:] != (channels, taps - 1):
        raise ValueError(f"history {tuple(history.shape)} for {channels} channels and {taps} taps")
    qkv, a, b, z = (u if u.stride(-1) == 1 else u.contiguous() for u in (qkv, a, b, z))
    o = torch.empty((t, heads_v, dv), dtype=torch.float32, device=qkv.device)
    out = torch.empty((t, heads_v * dv), dtype=dtype, device=qkv.device)
    count = arrival.counters(qkv.device, t * (heads_k + heads_v))
    _gdn_step_kernel[(t, heads_v, dv // block_v)](
        qkv, history, conv_weight.contiguous(), a, b, a_log, dt_bias, state, slots, z, norm_weight, o, out,
        count, qkv.stride(0), a.stride(0), b.stride(0), z.stride(0), heads_v, heads_k, heads_v // heads_k,
        heads_k * dk, channels, eps, DK=dk, DV=dv, BV=block_v, TAPS=taps,
        BW=triton.next_power_of_2(taps - 1), **launch(qkv.device),
    )  # fmt: skip
    return out
