"""Decode MoE over bf16 or fp8 (128×128 block scales) experts read in place from their pool rows.

Each pair's weights are read once, in place, and multiplied in registers, where torch gathers the chosen
experts' rows into a new tensor (the int4 kernels' two-kernel structure, common/kernels/moe_int4.py):

1. gate/up: program (pair p, block of I columns) → silu(gate) · up in fp32, act [P, I].
2. down: program (pair p, block of H rows) → act[p] · down^T times the routing weight, partial [P, H] fp32,
   added over the k choices of each token by the caller (a fixed order: no dependence on scheduling).

The expert widths are compile-time constants (one compilation a matrix shape).

Layouts (common/experts/formats.py): bf16 `gate_up` [R, 2I, H], `down` [R, H, I]; fp8 the same shapes in
float8_e4m3fn with `*_scale_inv` fp32 [R, ceil(out/128), ceil(in/128)] (w ≈ code · scale of its block). A
loop step reads 128 inputs: one fp8 block column, so a row's scale is one load a step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

BK = tl.constexpr(128)
"""Inputs per loop step (the fp8 scale block)."""


@triton.jit
def _rows_dot(w_ptr, s_ptr, out_rows, live_rows, v, k0, width, s_cols, FP8: tl.constexpr):
    """Σ_j w[out_rows, k0 + j] · v[j] over one step of BK inputs → [BLOCK] fp32 (fp8: times the block's
    scale). `w_ptr`/`s_ptr` point at the expert's matrix and scales."""
    c = k0 + tl.arange(0, BK)
    live = live_rows[:, None] & (c < width)[None, :]
    w = tl.load(w_ptr + out_rows[:, None].to(tl.int64) * width + c[None, :], mask=live, other=0.0)
    dot = tl.sum(w.to(tl.float32) * v[None, :], axis=1)
    if FP8:
        dot *= tl.load(s_ptr + (out_rows // BK) * s_cols + k0 // BK, mask=live_rows, other=0.0)
    return dot


@triton.jit
def _gate_up_kernel(
    x_ptr, rows_ptr, w_ptr, s_ptr, act_ptr, k, s_rows, s_cols,
    hidden: tl.constexpr, inter: tl.constexpr, FP8: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    p = tl.program_id(0)
    t = p // k
    row = tl.load(rows_ptr + p).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] act columns
    live = n < inter
    w = w_ptr + row * (2 * inter) * hidden
    s = s_ptr + row * s_rows * s_cols
    gate = tl.zeros((BLOCK,), dtype=tl.float32)
    up = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, hidden, BK):
        c = k0 + tl.arange(0, BK)
        xv = tl.load(x_ptr + t * hidden + c, mask=c < hidden, other=0.0).to(tl.float32)
        gate += _rows_dot(w, s, n, live, xv, k0, hidden, s_cols, FP8)
        up += _rows_dot(w, s, n + inter, live, xv, k0, hidden, s_cols, FP8)
    act = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) · up
    tl.store(act_ptr + p * inter + n, act, mask=live)


@triton.jit
def _down_kernel(
    act_ptr, rows_ptr, weights_ptr, w_ptr, s_ptr, out_ptr, s_rows, s_cols,
    hidden: tl.constexpr, inter: tl.constexpr, FP8: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    p = tl.program_id(0)
    row = tl.load(rows_ptr + p).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] output rows
    live = n < hidden
    w = w_ptr + row * hidden * inter
    s = s_ptr + row * s_rows * s_cols
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, inter, BK):
        c = k0 + tl.arange(0, BK)
        a = tl.load(act_ptr + p * inter + c, mask=c < inter, other=0.0)
        acc += _rows_dot(w, s, n, live, a, k0, inter, s_cols, FP8)
    tl.store(out_ptr + p * hidden + n, acc * tl.load(weights_ptr + p).to(tl.float32), mask=live)


def _scales(pool: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, int, int]:
    """(scale tensor, its rows and columns per expert) of matrix `name`; for bf16 the weights stand in (never
    read: the kernels' FP8 branch is compiled out)."""
    scale = pool.get(f"{name}_scale_inv")
    if scale is None:
        return pool[name], 1, 1
    return scale, scale.shape[1], scale.shape[2]


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

    x [T, H] (contiguous); rows, weights [T, k]; pool: a bf16 pool (`gate_up` [R, 2I, H], `down` [R, H, I])
    or an fp8 one (the same in e4m3, with `gate_up_scale_inv` and `down_scale_inv`). Any H and I. Fixed
    launch shapes, no host sync: a recorded step can hold it. `before_down` runs between the two kernels (to
    wait for the down rows' copies); `block` (output rows per program) and `num_warps` are tuning knobs.
    """
    t, k = rows.shape
    hidden, inter = pool["down"].shape[1:]
    fp8 = "gate_up_scale_inv" in pool
    pairs = t * k
    rows = rows.reshape(-1).contiguous()
    act = torch.empty((pairs, inter), dtype=torch.float32, device=x.device)
    scale, s_rows, s_cols = _scales(pool, "gate_up")
    _gate_up_kernel[(pairs, triton.cdiv(inter, block))](
        x.contiguous(), rows, pool["gate_up"], scale, act, k, s_rows, s_cols,
        hidden=hidden, inter=inter, FP8=fp8, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip
    partial = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)
    if before_down is not None:
        before_down()
    scale, s_rows, s_cols = _scales(pool, "down")
    _down_kernel[(pairs, triton.cdiv(hidden, block))](
        act, rows, weights.reshape(-1).contiguous(), pool["down"], scale, partial, s_rows, s_cols,
        hidden=hidden, inter=inter, FP8=fp8, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip
    return partial.view(t, k, hidden).sum(1).to(x.dtype)
