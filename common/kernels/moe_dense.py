"""Decode MoE over bf16, fp8 (128×128 block scales), NVFP4 or MXFP4 experts read in place from their pool
rows.

Each pair's weights are read once, in place (torch would gather the chosen rows into a new tensor), in the
int4 kernels' two-kernel structure:

1. gate/up: program (pair p, block of I columns) → silu(gate) · up in fp32, act [P, I].
2. down: program (pair p, block of H rows) → act[p] · down^T times the routing weight, partial [P, H] fp32,
   summed over each token's k choices by the caller (a fixed order).

Layouts (common/experts/formats.py): bf16 `gate_up` [R, 2I, H], `down` [R, H, I]; fp8 the same in e4m3
with `*_scale_inv` [R, ceil(out/128), ceil(in/128)] (a loop step of 128 inputs: one scale load a row). NVFP4
and MXFP4: e2m1 codes two a byte [R, out, in/2], a scale per 16 (e4m3) or 32 (e8m0) inputs, NVFP4's global
scale per linear ([R, 2]: gate, up; [R, 1]) applied after the sum; decoded in registers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

BK = tl.constexpr(128)
"""Inputs per loop step (the fp8 scale block)."""
BF16, FP8, NVFP4, MXFP4 = 0, 1, 2, 3
"""The pool's layout (the kernels' `FMT`)."""


@triton.jit
def _e2m1(code):
    """4-bit e2m1 codes (int32) → fp32 values: sign bit 3, exponent bits 1-2, mantissa bit 0."""
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    magnitude = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * tl.exp2((e - 1).to(tl.float32)))
    return tl.where(code >= 8, -magnitude, magnitude)


@triton.jit
def _fp4_scale(b, FMT: tl.constexpr):
    """Block scale bytes (int32) → fp32: e4m3 (NVFP4; finite codes) or e8m0, 2^(b − 127) (MXFP4)."""
    if FMT == 2:
        e = (b >> 3) & 15
        m = (b & 7).to(tl.float32)
        magnitude = tl.where(e == 0, m * 0.001953125, (1.0 + m * 0.125) * tl.exp2((e - 7).to(tl.float32)))
        return tl.where(b >= 128, -magnitude, magnitude)  # 0.001953125 = 2^-9: subnormal m/8 · 2^-6
    return tl.exp2((b - 127).to(tl.float32))


@triton.jit
def _rows_dot(w_ptr, s_ptr, out_rows, live_rows, v, k0, width, s_cols, FMT: tl.constexpr):
    """Σ_j w[out_rows, k0 + j] · v[j] over one step of BK inputs → [BLOCK] fp32 (fp8: times the block's
    scale; fp4: each code times its block's scale). `w_ptr`/`s_ptr` point at the expert's matrix and
    scales (fp4: `s_cols` unused, the scales' row is width / group)."""
    c = k0 + tl.arange(0, BK)
    live = live_rows[:, None] & (c < width)[None, :]
    rows = out_rows[:, None].to(tl.int64)
    if FMT >= 2:
        group: tl.constexpr = 16 if FMT == 2 else 32
        byte = tl.load(w_ptr + rows * (width // 2) + (c // 2)[None, :], mask=live, other=0).to(tl.int32)
        code = (byte >> ((c % 2) * 4)[None, :]) & 15
        b = tl.load(s_ptr + rows * (width // group) + (c // group)[None, :], mask=live, other=0).to(tl.int32)
        return tl.sum(_e2m1(code) * _fp4_scale(b, FMT) * v[None, :], axis=1)
    w = tl.load(w_ptr + rows * width + c[None, :], mask=live, other=0.0)
    dot = tl.sum(w.to(tl.float32) * v[None, :], axis=1)
    if FMT == 1:
        dot *= tl.load(s_ptr + (out_rows // BK) * s_cols + k0 // BK, mask=live_rows, other=0.0)
    return dot


@triton.jit
def _matrix_offsets(row, rows_out, width, s_rows, s_cols, FMT: tl.constexpr):
    """(weights, scales) element offsets of pool row `row`'s matrix of `rows_out` × `width`."""
    if FMT >= 2:
        group: tl.constexpr = 16 if FMT == 2 else 32
        return row * rows_out * (width // 2), row * rows_out * (width // group)
    return row * rows_out * width, row * s_rows * s_cols


@triton.jit
def _gate_up_kernel(
    x_ptr, rows_ptr, w_ptr, s_ptr, g_ptr, act_ptr, k, s_rows, s_cols,
    hidden: tl.constexpr, inter: tl.constexpr, FMT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    p = tl.program_id(0)
    t = p // k
    row = tl.load(rows_ptr + p).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] act columns
    live = n < inter
    w_off, s_off = _matrix_offsets(row, 2 * inter, hidden, s_rows, s_cols, FMT)
    w, s = w_ptr + w_off, s_ptr + s_off
    gate = tl.zeros((BLOCK,), dtype=tl.float32)
    up = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, hidden, BK):
        c = k0 + tl.arange(0, BK)
        xv = tl.load(x_ptr + t * hidden + c, mask=c < hidden, other=0.0).to(tl.float32)
        gate += _rows_dot(w, s, n, live, xv, k0, hidden, s_cols, FMT)
        up += _rows_dot(w, s, n + inter, live, xv, k0, hidden, s_cols, FMT)
    if FMT == 2:  # NVFP4's global scales: gate's, up's
        gate *= tl.load(g_ptr + 2 * row)
        up *= tl.load(g_ptr + 2 * row + 1)
    act = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) · up
    tl.store(act_ptr + p * inter + n, act, mask=live)


@triton.jit
def _down_kernel(
    act_ptr, rows_ptr, weights_ptr, w_ptr, s_ptr, g_ptr, out_ptr, s_rows, s_cols,
    hidden: tl.constexpr, inter: tl.constexpr, FMT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    p = tl.program_id(0)
    row = tl.load(rows_ptr + p).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] output rows
    live = n < hidden
    w_off, s_off = _matrix_offsets(row, hidden, inter, s_rows, s_cols, FMT)
    w, s = w_ptr + w_off, s_ptr + s_off
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, inter, BK):
        c = k0 + tl.arange(0, BK)
        a = tl.load(act_ptr + p * inter + c, mask=c < inter, other=0.0)
        acc += _rows_dot(w, s, n, live, a, k0, inter, s_cols, FMT)
    if FMT == 2:  # NVFP4's global scale
        acc *= tl.load(g_ptr + row)
    tl.store(out_ptr + p * hidden + n, acc * tl.load(weights_ptr + p).to(tl.float32), mask=live)


def _layout(pool: dict[str, torch.Tensor]) -> tuple[int, int, int]:
    """(FMT, hidden, inter) of a pool."""
    if "down_weight" in pool:  # [R, H, I/2]
        return NVFP4, pool["down_weight"].shape[1], 2 * pool["down_weight"].shape[2]
    if "down_blocks" in pool:  # [R, H, I/32, 16]
        return MXFP4, pool["down_blocks"].shape[1], 32 * pool["down_blocks"].shape[2]
    hidden, inter = pool["down"].shape[1:]
    return (FP8 if "gate_up_scale_inv" in pool else BF16), hidden, inter


def _operands(
    pool: dict[str, torch.Tensor], name: str, fmt: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """(weights, scales, global scales, scale rows, scale columns) of matrix `name` as the kernels take
    them; a tensor a format lacks is stood in by the weights (never read: its branch is compiled out)."""
    if fmt == NVFP4:
        w, s = pool[f"{name}_weight"], pool[f"{name}_weight_scale"].view(torch.uint8)
        return w, s, pool[f"{name}_weight_scale_2"], 1, 1
    if fmt == MXFP4:
        return pool[f"{name}_blocks"], pool[f"{name}_scales"], pool[f"{name}_blocks"], 1, 1
    scale = pool.get(f"{name}_scale_inv")
    if scale is None:
        return pool[name], pool[name], pool[name], 1, 1
    return pool[name], scale, pool[name], scale.shape[1], scale.shape[2]


def moe_dense_decode(
    x: torch.Tensor,
    rows: torch.Tensor,
    weights: torch.Tensor,
    pool: dict[str, torch.Tensor],
    block: int = 16,
    before_down: Callable[[], None] | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """Σ_j weights[t, j] · SwiGLU expert at pool row rows[t, j] (x[t]) → [T, H] in x's dtype.

    x [T, H] (contiguous); rows, weights [T, k]; pool: a bf16 pool (`gate_up` [R, 2I, H], `down` [R, H, I]),
    an fp8 one (the same in e4m3, with `gate_up_scale_inv` and `down_scale_inv`), or an NVFP4 / MXFP4 one
    (their formats' components). Any H and I the format takes. Fixed
    launch shapes, no host sync: a recorded step can hold it. `before_down` runs between the two kernels (to
    wait for the down rows' copies); `block` (output rows per program) and `num_warps` are tuning knobs.
    """
    t, k = rows.shape
    fmt, hidden, inter = _layout(pool)
    pairs = t * k
    rows = rows.reshape(-1).contiguous()
    act = torch.empty((pairs, inter), dtype=torch.float32, device=x.device)
    w, scale, glob, s_rows, s_cols = _operands(pool, "gate_up", fmt)
    _gate_up_kernel[(pairs, triton.cdiv(inter, block))](
        x.contiguous(), rows, w, scale, glob, act, k, s_rows, s_cols,
        hidden=hidden, inter=inter, FMT=fmt, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip
    partial = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)
    if before_down is not None:
        before_down()
    w, scale, glob, s_rows, s_cols = _operands(pool, "down", fmt)
    _down_kernel[(pairs, triton.cdiv(hidden, block))](
        act, rows, weights.reshape(-1).contiguous(), w, scale, glob, partial, s_rows, s_cols,
        hidden=hidden, inter=inter, FMT=fmt, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip
    return partial.view(t, k, hidden).sum(1).to(x.dtype)
