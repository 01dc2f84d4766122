"""The depthwise causal conv (common/model/qwen4_exp/varlen.py `causal_conv`) in Triton, optionally SiLU'd:

- `conv_step`, a decode step: one token per sequence, the conv history shifted in place in its slot. In torch
  the step is ~10 kernels (gather the slots' histories, pad, concatenate, conv1d, gather the new history,
  scatter it back, unpad). Here program (token t, block of channels) reads the K taps of its channels —
  history entries at j·dilation, the new input last — and writes the history shifted by one.
- `conv_prefill`, any pass over the flat [T, C] layout: each tap reads the input `(K−1−j)·dilation` tokens
  back, or the slot's history where that lies before the pass. torch pads, transposes and concatenates the
  [C, L] layout for a depthwise conv1d, with the SiLU and the copies beside it; this reads x once and writes
  the output once. The new histories (a few entries a
  sequence) are then gathered in torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

import torch
import triton
import triton.language as tl

from common.kernels.config import KERNELS, KernelConfig
from common.kernels.pdl import gdc_enter, launch


@triton.jit
def _conv_step_kernel(
    x_ptr, hist_ptr, slots_ptr, w_ptr, out_ptr, channels, width,
    K: tl.constexpr, DILATION: tl.constexpr, BC: tl.constexpr, BW: tl.constexpr, SILU: tl.constexpr,
    GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(GDC)
    t = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    live = c < channels
    slot = tl.load(slots_ptr + t).to(tl.int64)
    x = tl.load(x_ptr + t * channels + c, mask=live, other=0.0).to(tl.float32)
    acc = conv_channels(x, hist_ptr, slot, w_ptr, c, live, channels, width, K, DILATION, BW, SILU)
    tl.store(out_ptr + t * channels + c, acc.to(out_ptr.dtype.element_ty), mask=live)


@triton.jit
def conv_channels(
    x, hist_ptr, slot, w_ptr, c, live, channels, width,
    K: tl.constexpr, DILATION: tl.constexpr, BW: tl.constexpr, SILU: tl.constexpr,
):  # fmt: skip
    """One token's conv over channels c [BC] (`live` of them): x [BC] fp32 its new inputs, as the history
    stores them (rounded to its dtype) → the conv output [BC] fp32 (SiLU'd with SILU); the slot's history
    [channels, width] rows shifted by one, x last. Also the epilogue of the GEMV that makes x (gemv.py)."""
    i = tl.arange(0, BW)
    row = hist_ptr + (slot * channels + c[:, None]) * width + i[None, :]  # [BC, BW]
    hist = tl.load(row, mask=live[:, None] & (i[None, :] < width), other=0.0).to(tl.float32)
    acc = tl.zeros(x.shape, dtype=tl.float32)
    for j in tl.static_range(K):  # tap j reads history entry j·dilation; the last tap, the new input
        if j < K - 1:  # noqa: SIM108  (a static branch: Triton specialises it)
            tap = tl.sum(tl.where(i[None, :] == j * DILATION, hist, 0.0), axis=1)
        else:
            tap = x
        acc += tap * tl.load(w_ptr + c * K + j, mask=live, other=0.0).to(tl.float32)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    # history ← its last width−1 entries, then x (entry i takes entry i+1)
    shifted = tl.load(row + 1, mask=live[:, None] & (i[None, :] < width - 1), other=0.0)
    shifted = tl.where(i[None, :] == width - 1, x[:, None].to(shifted.dtype), shifted)
    tl.debug_barrier()  # every program reads its own rows only: the barrier orders the loads before stores
    tl.store(row, shifted.to(hist_ptr.dtype.element_ty), mask=live[:, None] & (i[None, :] < width))
    return acc


def history_width(history: torch.Tensor, weight: torch.Tensor, dilation: int) -> int:
    """W of history [S, C, W], which must be (K − 1)·dilation for weight [C, K]."""
    width, kernel = history.shape[2], weight.shape[1]
    if width != (kernel - 1) * dilation:
        raise ValueError(f"history of {width} for a kernel of {kernel} at dilation {dilation}")
    return width


def conv_step(
    x: torch.Tensor,
    history: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    dilation: int = 1,
    silu: bool = False,
    block: int = 128,
    kernels: KernelConfig = KERNELS,
) -> torch.Tensor:
    """One token per sequence: x [T, C], history [S, C, W] (W = (K−1)·dilation, sequence t's at slots[t],
    shifted in place), weight [C, K] → conv output [T, C] in x's dtype (SiLU'd with `silu`)."""
    t, channels = x.shape
    kernel, width = weight.shape[1], history_width(history, weight, dilation)
    out = torch.empty_like(x)
    _conv_step_kernel[(t, triton.cdiv(channels, block))](
        x.contiguous(), history, slots, weight.contiguous(), out, channels, width,
        K=kernel, DILATION=dilation, BC=block, BW=triton.next_power_of_2(width), SILU=silu,
        **launch(x.device, kernels=kernels),
    )  # fmt: skip
    return out


@triton.jit
def _conv_prefill_kernel(
    x_ptr, hist_ptr, slots_ptr, seq_ptr, offset_ptr, w_ptr, out_ptr, tokens, channels, width, x_stride,
    hist_stride, K: tl.constexpr, DILATION: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    SILU: tl.constexpr,
):  # fmt: skip
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)  # [BT] flat tokens (T·C may pass 2³¹)
    c = tl.program_id(1) * BC + tl.arange(0, BC)  # [BC]
    live_t, live_c = t < tokens, c < channels
    live = live_t[:, None] & live_c[None, :]
    slot = tl.load(slots_ptr + tl.load(seq_ptr + t, mask=live_t, other=0), mask=live_t, other=0).to(tl.int64)
    offset = tl.load(offset_ptr + t, mask=live_t, other=0)  # [BT] index of the token within its pass
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    for j in tl.static_range(K):
        back = (K - 1 - j) * DILATION
        rel = offset - back  # [BT] where tap j's input lies in the pass (< 0: in the history)
        in_x = (rel >= 0)[:, None]
        xv = tl.load(x_ptr + (t - back)[:, None] * x_stride + c[None, :], mask=live & in_x, other=0.0)
        at = slot[:, None] * hist_stride + c[None, :] * width + (width + rel)[:, None]
        hv = tl.load(hist_ptr + at, mask=live & ~in_x, other=0.0)
        tap = xv.to(tl.float32) + hv.to(tl.float32)  # one of the two is 0
        acc += tap * tl.load(w_ptr + c * K + j, mask=live_c, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + t[:, None] * channels + c[None, :], acc.to(out_ptr.dtype.element_ty), mask=live)


@overload
def conv_prefill(
    x: torch.Tensor,
    history: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    seq: torch.Tensor,
    offset: torch.Tensor,
    lens: torch.Tensor,
    dilation: int = 1,
    silu: bool = False,
    split: None = None,
) -> torch.Tensor: ...


@overload
def conv_prefill(
    x: torch.Tensor,
    history: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    seq: torch.Tensor,
    offset: torch.Tensor,
    lens: torch.Tensor,
    dilation: int,
    silu: bool,
    split: Sequence[int],
) -> list[torch.Tensor]: ...


def conv_prefill(
    x: torch.Tensor,
    history: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    seq: torch.Tensor,
    offset: torch.Tensor,
    lens: torch.Tensor,
    dilation: int = 1,
    silu: bool = False,
    split: Sequence[int] | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """x [T, C] flat (sequence b's tokens consecutive; token t of batch sequence seq[t] at index offset[t]
    of its pass, lens [B] tokens a sequence; its rows may be strided: a view of a fused projection's
    output, read in place), history [S, C, W] (W = (K−1)·dilation, sequence b's at slots[b], updated in
    place to the W inputs ending at its last token), weight [C, K] → conv output [T, C] in x's dtype
    (SiLU'd with `silu`). `split`: channel counts; the output as one contiguous [T, n] per group instead
    (GDN's q, k and v, which fla copies to contiguous memory otherwise)."""
    tokens, channels = x.shape
    kernel, width = weight.shape[1], history_width(history, weight, dilation)
    assert x.stride(1) == 1 and history.stride(2) == 1 and history.stride(1) == width, "row-major x, history"
    outs, start = [], 0
    for n in split or (channels,):
        out = torch.empty((tokens, n), dtype=x.dtype, device=x.device)
        bt, bc = 32, 128
        _conv_prefill_kernel[(triton.cdiv(tokens, bt), triton.cdiv(n, bc))](
            x[:, start:], history[:, start:], slots, seq, offset, weight[start:].contiguous(), out, tokens,
            n, width, x.stride(0), history.stride(0), K=kernel, DILATION=dilation, BT=bt, BC=bc, SILU=silu,
        )  # fmt: skip
        outs.append(out)
        start += n
    assert start == channels, f"split {split} does not cover {channels} channels"
    _keep_history(x, history, slots, lens, width)
    return outs if split is not None else outs[0]


def _keep_history(
    x: torch.Tensor, history: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, width: int
) -> None:
    """Each sequence's history [C, W] ← the W inputs ending at its last token of the pass x [T, C]."""
    # new history entry i: the input at rel = lens − W + i of the pass, or (rel < 0) old entry W + rel
    rel = lens[:, None] - width + torch.arange(width, device=x.device)  # [B, W]
    starts = lens.cumsum(0) - lens
    from_x = x[starts[:, None] + rel.clamp(min=0)].transpose(1, 2)  # [B, C, W]
    old = history[slots]  # [B, C, W]
    from_old = old.gather(2, (width + rel).clamp(max=width - 1)[:, None, :].expand(-1, x.shape[1], -1))
    history[slots] = torch.where((rel >= 0)[:, None, :], from_x.to(history.dtype), from_old)
