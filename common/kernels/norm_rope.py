"""Per-head RMSNorm with weight (1 + w) followed by rotary embedding, as one Triton kernel (QSA's q and k
norms and its indexer's query norm, each followed by partial RoPE in the rotate-half layout).

In torch the pair is ~15 kernels (the norm's casts and reductions, the rotary's slices, negation and
concatenations), and the step's cos/sin ~9 more; here the angles come from the positions and the rotary's
inverse frequencies. Program (token, head) normalises its head in fp32 and rotates it: entry i < rot/2
pairs with i + rot/2 (and back); entries past `rot` pass through. The partner is re-read from memory rather
than moved between registers, and normalised with the same factor.
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl

from common.kernels.config import KERNELS, KernelConfig
from common.kernels.pdl import gdc_enter, launch


class Rotary(Protocol):
    """What the RoPE kernels read of a rotary embedding (common/model/rope.py's RotaryEmbedding)."""

    inv_freq: torch.Tensor
    """[rot_dim / 2] fp32 inverse frequencies."""
    scaling: float
    """The scale applied to cos and sin."""
    rot_dim: int
    """Rotated channels of a head (the first ones)."""


@triton.jit
def _norm_rope_kernel(
    x_ptr, w_ptr, pos_ptr, inv_freq_ptr, out_ptr, stride_t, stride_h, heads, eps, rot, scaling,
    k_pages_ptr, v_ptr, v_stride_t, v_stride_h, v_pages_ptr, slots_ptr,
    D: tl.constexpr, STORE: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(GDC)
    _norm_rope_head(
        x_ptr, w_ptr, pos_ptr, inv_freq_ptr, out_ptr, stride_t, stride_h, heads, eps, rot, scaling,
        k_pages_ptr, v_ptr, v_stride_t, v_stride_h, v_pages_ptr, slots_ptr, tl.program_id(0),
        tl.program_id(1), D, STORE,
    )  # fmt: skip


@triton.jit
def _norm_rope_head(
    x_ptr, w_ptr, pos_ptr, inv_freq_ptr, out_ptr, stride_t, stride_h, heads, eps, rot, scaling,
    k_pages_ptr, v_ptr, v_stride_t, v_stride_h, v_pages_ptr, slots_ptr, t, h,
    D: tl.constexpr, STORE: tl.constexpr,
):  # fmt: skip
    """Token t's head h normalised and rotated into out [T, heads, D] (and with STORE, stored as a key with
    its value): the kernel's program (t, h), and a program of common/kernels/qsa_prologue.py."""
    dtype = out_ptr.dtype.element_ty
    i = tl.arange(0, D)
    half = rot // 2
    partner = tl.where(i < half, i + half, i - half)
    rotated = i < rot
    row = x_ptr + t * stride_t + h * stride_h
    x = tl.load(row + i).to(tl.float32)
    factor = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    normed = x * factor * (1.0 + tl.load(w_ptr + i).to(tl.float32))
    other = tl.load(row + partner, mask=rotated, other=0.0).to(tl.float32) * factor
    other = other * (1.0 + tl.load(w_ptr + partner, mask=rotated, other=0.0).to(tl.float32))
    # cos/sin as RotaryEmbedding.cos_sin makes them: fp32 angles, scaled, rounded to the activations' dtype
    freq = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_freq_ptr + i % half, mask=rotated, other=0.0)
    cos = tl.where(rotated, (tl.cos(freq) * scaling).to(dtype).to(tl.float32), 1.0)
    sin = tl.where(rotated, (tl.sin(freq) * scaling).to(dtype).to(tl.float32), 0.0)
    out = (normed * cos + tl.where(i < half, -other, other) * sin).to(dtype)
    tl.store(out_ptr + (t * heads + h) * D + i, out)
    if STORE:  # the token's key and value into their pages, at its KV slot
        at = (tl.load(slots_ptr + t).to(tl.int64) * heads + h) * D + i
        tl.store(k_pages_ptr + at, out.to(k_pages_ptr.dtype.element_ty))
        v = tl.load(v_ptr + t * v_stride_t + h * v_stride_h + i)
        tl.store(v_pages_ptr + at, v.to(v_pages_ptr.dtype.element_ty))


def norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    rotary: Rotary,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    kernels: KernelConfig = KERNELS,
) -> torch.Tensor:
    """x [T, H, D] (last dim contiguous; D a power of two), weight [D] (the norm's w: scaled by 1 + w),
    positions [T] → RoPE(RMSNorm(x)) [T, H, D] in x's dtype, the rotary's cos/sin (`rotary.cos_sin` in x's
    dtype) computed in the kernel. `store` (k_pages, v, v_pages, slot_mapping):
    the result is also a key that the kernel stores in k_pages [slots, H, D] at slot_mapping [T], and the
    value v [T, H, D] (rows may be strided, the last dim's 1) in v_pages (what `write_kv` does, for pages
    not in fp8: one launch instead of two)."""
    t, heads, dim = x.shape
    if x.stride(2) != 1 or dim & (dim - 1):
        raise ValueError(
            f"norm_rope needs a contiguous last dim of a power-of-two size, got {tuple(x.shape)}"
        )
    out = torch.empty((t, heads, dim), dtype=x.dtype, device=x.device)
    k_pages, v, v_pages, slots = store if store is not None else (out, out, out, out)  # unread: no store
    if store is not None:
        assert k_pages.shape[1:] == (heads, dim) and v.shape == x.shape and v.stride(2) == 1
        assert k_pages.is_contiguous() and v_pages.is_contiguous(), "pages: flat [slots, H, D]"
    _norm_rope_kernel[(t, heads)](
        x, weight, positions, rotary.inv_freq, out, x.stride(0), x.stride(1), heads, eps, rotary.rot_dim,
        rotary.scaling, k_pages, v, v.stride(0), v.stride(1), v_pages, slots,
        D=dim, STORE=store is not None, **launch(x.device, kernels=kernels),
    )  # fmt: skip
    return out
