"""Prefill MoE over int4 experts as bf16 grouped GEMMs: a batch of experts at a time is dequantised once into
a workspace (one Triton kernel), then `torch._grouped_mm` (CUTLASS's grouped GEMM on sm90) multiplies the
(token, choice) pairs sorted by expert against it, gate/up and then down.

The grouped int4 kernels (moe_int4.py) dequantise a weight tile again for every block of pairs that uses the
expert: at 25.6K tokens × top-10 over 512 experts (~500 pairs an expert) that is ~16 times per weight, and
the small tiles leave the tensor cores mostly idle (~34 TFLOP/s measured). Here each weight is dequantised
once per pass (int4 read, bf16 written and read back: ~11 GB a layer of flashnext, ~3 ms at HBM rate) and
the products run as large GEMMs. The price is a workspace of `experts_per_batch` dequantised experts and
one host sync per layer (the pairs per batch of experts: prefill is not captured in a graph). At 25.6K
tokens of flashnext that is ~0.5 GB more than the grouped kernels' (common/memory_plan.py counts theirs:
count this one there if it becomes the default).

Rounding: each pair's down product is rounded to the activation dtype before the routing weight (the
kernels scale in fp32 first), and gate/up come out of the GEMM rounded; the k terms of a token are summed in
fp32 in choice order, as in moe_int4.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

GROUP = tl.constexpr(128)  # inputs per scale (a constexpr: the kernel reads it)


@triton.jit
def _dequant_kernel(
    w_ptr, s_ptr, z_ptr, rows_ptr, out_ptr, rows_out, in_half, groups, BR: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    """Program (expert j of the batch, BR output rows): out[j, r, :] = (codes − zero) · scale, interleaving
    each byte's low (even input) and high (odd input) nibble."""
    j = tl.program_id(0)
    row = tl.load(rows_ptr + j).to(tl.int64)  # the expert's pool row
    r = tl.program_id(1) * BR + tl.arange(0, BR)  # [BR] output rows
    c = tl.arange(0, BLOCK)  # [BLOCK] byte columns
    live = (r < rows_out)[:, None] & (c < in_half)[None, :]
    at = (row * rows_out + r)[:, None]  # (pool row, output row) among [R, rows_out]
    packed = tl.load(w_ptr + at * in_half + c[None, :], mask=live, other=0)
    group = (c // (GROUP // 2))[None, :]
    scale = tl.load(s_ptr + at * groups + group, mask=live, other=0).to(tl.float32)
    zero = tl.load(z_ptr + at * groups + group, mask=live, other=0).to(tl.float32)
    even = ((packed & 15).to(tl.float32) - zero) * scale
    odd = ((packed >> 4).to(tl.float32) - zero) * scale
    dst = out_ptr + (j * rows_out + r).to(tl.int64)[:, None] * (2 * in_half) + 2 * c[None, :]
    tl.store(dst, even.to(out_ptr.dtype.element_ty), mask=live)
    tl.store(dst + 1, odd.to(out_ptr.dtype.element_ty), mask=live)


DEQUANT_ROWS = 8
"""Output rows per dequantisation program."""


def dequantize_rows(
    pool: dict[str, torch.Tensor], name: str, rows: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The `name` matrix (gate_up or down) of the experts at pool rows `rows` [n] → [n, out, in], `dtype`."""
    codes, scales, zeros = (pool[f"{name}_{part}"] for part in ("qweight", "scales", "zeros"))
    _, rows_out, in_half = codes.shape
    out = torch.empty((rows.numel(), rows_out, 2 * in_half), dtype=dtype, device=codes.device)
    _dequant_kernel[(rows.numel(), triton.cdiv(rows_out, DEQUANT_ROWS))](
        codes, scales, zeros, rows.contiguous(), out, rows_out, in_half, scales.shape[2],
        BR=DEQUANT_ROWS, BLOCK=triton.next_power_of_2(in_half),
    )  # fmt: skip
    return out


def moe_int4_grouped_mm(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    rows: torch.Tensor,
    pool: dict[str, torch.Tensor],
    experts_per_batch: int = 32,
) -> torch.Tensor:
    """Prefill: Σ_j topk_weights[t, j] · SwiGLU expert topk_ids[t, j] (x[t]) → [T, H] in x's dtype, expert e's
    int4 weights at pool row rows[e] ([E] int64), `experts_per_batch` experts dequantised at a time."""
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # [P] pairs by expert
    ends = torch.bincount(flat, minlength=rows.numel()).cumsum(0)  # [E] end of each expert's pairs
    ends_host = ends.tolist()  # one sync a layer: the pairs of each batch of experts
    weights = topk_weights.reshape(-1)
    out = torch.zeros((t * k, x.shape[1]), dtype=x.dtype, device=x.device)  # [P, H] each pair's term
    for e0 in range(0, rows.numel(), experts_per_batch):
        e1 = min(e0 + experts_per_batch, rows.numel())
        p0, p1 = ends_host[e0 - 1] if e0 else 0, ends_host[e1 - 1]
        if p0 == p1:
            continue
        pairs = order[p0:p1]  # [n] this batch's pairs, by expert
        offs = (ends[e0:e1] - p0).to(torch.int32)  # [e1 − e0] end of each expert's pairs within them
        gate_up = dequantize_rows(pool, "gate_up", rows[e0:e1], x.dtype)  # [b, 2I, H]
        h = torch._grouped_mm(x[pairs // k], gate_up.transpose(1, 2), offs=offs)  # [n, 2I]
        del gate_up
        gate, up = h.chunk(2, dim=-1)
        act = F.silu(gate) * up  # [n, I]
        del h
        down = dequantize_rows(pool, "down", rows[e0:e1], x.dtype)  # [b, H, I]
        y = torch._grouped_mm(act, down.transpose(1, 2), offs=offs)  # [n, H]
        out[pairs] = (y.float() * weights[pairs, None]).to(x.dtype)
    return out.view(t, k, -1).sum(1, dtype=torch.float32).to(x.dtype)
