"""A decode step of the depthwise causal conv (common/model/qwen4_exp/varlen.py `causal_conv`) as one Triton
kernel: one token per sequence, the conv history shifted in place in its slot, optionally SiLU'd.

In torch the step is ~10 kernels (gather the slots' histories, pad, concatenate, conv1d, gather the new
history, scatter it back, unpad). Here program (token t, block of channels) reads the K taps of its channels
— history entries at j·dilation, the new input last — and writes the history shifted by one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_step_kernel(
    x_ptr, hist_ptr, slots_ptr, w_ptr, out_ptr, channels, width,
    K: tl.constexpr, DILATION: tl.constexpr, BC: tl.constexpr, BW: tl.constexpr, SILU: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    live = c < channels
    slot = tl.load(slots_ptr + t).to(tl.int64)
    x = tl.load(x_ptr + t * channels + c, mask=live, other=0.0).to(tl.float32)
    i = tl.arange(0, BW)
    row = hist_ptr + (slot * channels + c[:, None]) * width + i[None, :]  # [BC, BW]
    hist = tl.load(row, mask=live[:, None] & (i[None, :] < width), other=0.0).to(tl.float32)
    acc = tl.zeros((BC,), dtype=tl.float32)
    for j in tl.static_range(K):  # tap j reads history entry j·dilation; the last tap, the new input
        if j < K - 1:  # noqa: SIM108  (a static branch: Triton specialises it)
            tap = tl.sum(tl.where(i[None, :] == j * DILATION, hist, 0.0), axis=1)
        else:
            tap = x
        acc += tap * tl.load(w_ptr + c * K + j, mask=live, other=0.0).to(tl.float32)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + t * channels + c, acc.to(out_ptr.dtype.element_ty), mask=live)
    # history ← its last width−1 entries, then x (entry i takes entry i+1)
    shifted = tl.load(row + 1, mask=live[:, None] & (i[None, :] < width - 1), other=0.0)
    shifted = tl.where(i[None, :] == width - 1, x[:, None].to(shifted.dtype), shifted)
    tl.debug_barrier()  # every program reads its own rows only: the barrier orders the loads before stores
    tl.store(row, shifted.to(hist_ptr.dtype.element_ty), mask=live[:, None] & (i[None, :] < width))


def conv_step(
    x: torch.Tensor,
    history: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    dilation: int = 1,
    silu: bool = False,
    block: int = 128,
) -> torch.Tensor:
    """One token per sequence: x [T, C], history [S, C, W] (W = (K−1)·dilation, sequence t's at slots[t],
    shifted in place), weight [C, K] → conv output [T, C] in x's dtype (SiLU'd with `silu`)."""
    t, channels = x.shape
    kernel = weight.shape[1]
    width = history.shape[2]
    if width != (kernel - 1) * dilation:
        raise ValueError(f"history of {width} for a kernel of {kernel} at dilation {dilation}")
    out = torch.empty_like(x)
    _conv_step_kernel[(t, triton.cdiv(channels, block))](
        x.contiguous(), history, slots, weight.contiguous(), out, channels, width,
        K=kernel, DILATION=dilation, BC=block, BW=triton.next_power_of_2(width), SILU=silu,
    )  # fmt: skip
    return out
