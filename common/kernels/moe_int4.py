"""Decode MoE over int4 (W4A16, group 128) experts read in place from their pool rows: two Triton kernels.

The torch path dequantises every chosen expert to the activation dtype before its GEMVs: for top-10 of
2560×640 experts that is ~100 MB written and read again per layer to use 26 MB of int4. Here the codes are
read once, dequantised in registers and multiplied at once:

1. gate/up: program (pair p, block of I columns) computes gate and up rows of expert rows[p] against x[t]
   (t = p // k), and writes silu(gate) · up in fp32 — act [P, I].
2. down: program (pair p, block of H rows) computes act[p] · down^T and scales it by the routing weight —
   partial sums [P, H] fp32, added over the k choices of each token by the caller (a fixed order: the
   result does not depend on scheduling).

Int4 layout (common/experts/formats.py): qweight uint8 [R, out, in/2] (column 2j in the low nibble of byte j,
2j+1 in the high one), scales bf16 and zeros uint8 [R, out, in/128]; w = (q − zero) · scale. One loop step
covers one group of 128 inputs: Σ_j (q_j − z)·x_j = Σ_j q_j·x_j − z·Σ_j x_j, so the zero point costs one
multiply per row and group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP = 128


@triton.jit
def _group_dot(w_ptr, s_ptr, z_ptr, rows_out, in_half, groups, g, x_even, x_odd, x_sum, HALF: tl.constexpr):
    """Σ over one 128-input group of w[rows_out, :] · x for a block of output rows → [BLOCK] fp32."""
    cols = g * HALF + tl.arange(0, HALF)
    packed = tl.load(w_ptr + rows_out[:, None] * in_half + cols[None, :])  # [BLOCK, 64] uint8
    low = (packed & 15).to(tl.float32)
    high = (packed >> 4).to(tl.float32)
    dot = tl.sum(low * x_even[None, :] + high * x_odd[None, :], axis=1)
    scale = tl.load(s_ptr + rows_out * groups + g).to(tl.float32)
    zero = tl.load(z_ptr + rows_out * groups + g).to(tl.float32)
    return scale * (dot - zero * x_sum)


@triton.jit
def _gate_up_kernel(
    x_ptr, rows_ptr, w_ptr, s_ptr, z_ptr, act_ptr, k, hidden, inter,
    GROUPS: tl.constexpr, BLOCK: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    p = tl.program_id(0)
    t = p // k
    row = tl.load(rows_ptr + p).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] act columns (< inter: inter % BLOCK == 0)
    in_half, groups = GROUPS * HALF, GROUPS
    w = w_ptr + row * (2 * inter) * in_half
    s = s_ptr + row * (2 * inter) * groups
    z = z_ptr + row * (2 * inter) * groups
    gate = tl.zeros((BLOCK,), dtype=tl.float32)
    up = tl.zeros((BLOCK,), dtype=tl.float32)
    j = tl.arange(0, HALF)
    for g in range(GROUPS):
        x_even = tl.load(x_ptr + t * hidden + g * 2 * HALF + 2 * j).to(tl.float32)
        x_odd = tl.load(x_ptr + t * hidden + g * 2 * HALF + 2 * j + 1).to(tl.float32)
        x_sum = tl.sum(x_even + x_odd)
        gate += _group_dot(w, s, z, n, in_half, groups, g, x_even, x_odd, x_sum, HALF)
        up += _group_dot(w, s, z, n + inter, in_half, groups, g, x_even, x_odd, x_sum, HALF)
    act = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) · up
    tl.store(act_ptr + p * inter + n, act)


@triton.jit
def _down_kernel(
    act_ptr, rows_ptr, weights_ptr, w_ptr, s_ptr, z_ptr, out_ptr, hidden, inter,
    GROUPS: tl.constexpr, BLOCK: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    p = tl.program_id(0)
    row = tl.load(rows_ptr + p).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] output rows (< hidden)
    in_half, groups = GROUPS * HALF, GROUPS
    w = w_ptr + row * hidden * in_half
    s = s_ptr + row * hidden * groups
    z = z_ptr + row * hidden * groups
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    j = tl.arange(0, HALF)
    for g in range(GROUPS):
        a_even = tl.load(act_ptr + p * inter + g * 2 * HALF + 2 * j)
        a_odd = tl.load(act_ptr + p * inter + g * 2 * HALF + 2 * j + 1)
        acc += _group_dot(w, s, z, n, in_half, groups, g, a_even, a_odd, tl.sum(a_even + a_odd), HALF)
    tl.store(out_ptr + p * hidden + n, acc * tl.load(weights_ptr + p).to(tl.float32))


def moe_int4_decode(
    x: torch.Tensor,
    rows: torch.Tensor,
    weights: torch.Tensor,
    pool: dict[str, torch.Tensor],
    block: int = 16,
) -> torch.Tensor:
    """Σ_j weights[t, j] · SwiGLU expert at pool row rows[t, j] (x[t]) → [T, H] in x's dtype.

    x [T, H] (bf16/fp16/fp32, contiguous); rows, weights [T, k]; pool: an int4 pool's components
    (`gate_up_qweight` [R, 2I, H/2], `gate_up_scales`/`gate_up_zeros` [R, 2I, H/128], `down_*` likewise
    [R, H, ...]). H and I multiples of 128. Fixed launch shapes, no host sync: a recorded step can hold it.
    """
    t, k = rows.shape
    hidden = x.shape[1]
    inter = pool["down_qweight"].shape[2] * 2
    pairs = t * k
    rows = rows.reshape(-1).contiguous()
    act = torch.empty((pairs, inter), dtype=torch.float32, device=x.device)
    _gate_up_kernel[(pairs, inter // block)](
        x.contiguous(), rows, pool["gate_up_qweight"], pool["gate_up_scales"], pool["gate_up_zeros"], act,
        k, hidden, inter, GROUPS=hidden // GROUP, BLOCK=block, HALF=GROUP // 2,
    )  # fmt: skip
    partial = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)
    _down_kernel[(pairs, hidden // block)](
        act, rows, weights.reshape(-1).contiguous(), pool["down_qweight"], pool["down_scales"],
        pool["down_zeros"], partial, hidden, inter, GROUPS=inter // GROUP, BLOCK=block, HALF=GROUP // 2,
    )  # fmt: skip
    return partial.view(t, k, hidden).sum(1).to(x.dtype)
