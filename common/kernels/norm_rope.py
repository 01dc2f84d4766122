"""Per-head RMSNorm with weight (1 + w) followed by rotary embedding, as one Triton kernel (QSA's q and k
norms and its indexer's query norm, each followed by partial RoPE in the rotate-half layout).

In torch the pair is ~15 kernels (the norm's casts and reductions, the rotary's slices, negation and
concatenations). Program (token, head) normalises its head in fp32 and rotates it: entry i < rot/2 pairs with
i + rot/2 (and back); entries past `rot` pass through. The partner is re-read from memory rather than moved
between registers, and normalised with the same factor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.kernels.pdl import gdc_enter, launch


@triton.jit
def _norm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, stride_t, stride_h, heads, eps, rot,
    k_pages_ptr, v_ptr, v_stride_t, v_stride_h, v_pages_ptr, slots_ptr,
    D: tl.constexpr, STORE: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(GDC)
    t, h = tl.program_id(0), tl.program_id(1)
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
    cos = tl.load(cos_ptr + t * rot + i, mask=rotated, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * rot + i, mask=rotated, other=0.0).to(tl.float32)
    out = (normed * cos + tl.where(i < half, -other, other) * sin).to(out_ptr.dtype.element_ty)
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
    cos: torch.Tensor,
    sin: torch.Tensor,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [T, H, D] (last dim contiguous; D a power of two), weight [D] (the norm's w: scaled by 1 + w),
    cos/sin [T, rot] → RoPE(RMSNorm(x)) [T, H, D] in x's dtype. `store` (k_pages, v, v_pages, slot_mapping):
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
        x, weight, cos.contiguous(), sin.contiguous(), out, x.stride(0), x.stride(1), heads, eps,
        cos.shape[1], k_pages, v, v.stride(0), v.stride(1), v_pages, slots,
        D=dim, STORE=store is not None, **launch(x.device),
    )  # fmt: skip
    return out
