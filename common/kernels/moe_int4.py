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
2j+1 in the high one), scales bf16 and zeros uint8 [R, out, in/128]; w = (q − zero) · scale. A loop step
covers GROUPS_PER_STEP groups of 128 inputs; per group Σ_j (q_j − z)·x_j = Σ_j q_j·x_j − z·Σ_j x_j, so the
zero point costs one multiply per row and group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP = 128
GROUPS_PER_STEP = 4
"""Groups of 128 inputs one loop step reads: [BLOCK rows × 4 groups × 64 bytes] per load keeps enough bytes in
flight (one group per step left the kernels at ~0.5 TB/s)."""


@triton.jit
def _groups_dot(
    w_ptr, s_ptr, z_ptr, rows_out, g0, x_even, x_odd,
    GROUPS: tl.constexpr, GPB: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """Σ over groups g0..g0+GPB−1 (those < GROUPS) of w[rows_out, group] · x → [BLOCK] fp32.

    x_even, x_odd [GPB, HALF]: the groups' even and odd inputs (0 past the last group)."""
    gi = g0 + tl.arange(0, GPB)  # [GPB]
    live = gi < GROUPS
    cols = gi[:, None] * HALF + tl.arange(0, HALF)[None, :]  # [GPB, HALF] byte columns
    packed = tl.load(
        w_ptr + rows_out[:, None, None] * (GROUPS * HALF) + cols[None, :, :],
        mask=live[None, :, None],
        other=0,
    )  # [BLOCK, GPB, HALF] uint8
    low = (packed & 15).to(tl.float32)
    high = (packed >> 4).to(tl.float32)
    dot = tl.sum(low * x_even[None, :, :] + high * x_odd[None, :, :], axis=2)  # [BLOCK, GPB]
    at = rows_out[:, None] * GROUPS + gi[None, :]  # [BLOCK, GPB]
    scale = tl.load(s_ptr + at, mask=live[None, :], other=0).to(tl.float32)
    zero = tl.load(z_ptr + at, mask=live[None, :], other=0).to(tl.float32)
    x_sum = tl.sum(x_even + x_odd, axis=1)  # [GPB]
    return tl.sum(scale * (dot - zero * x_sum[None, :]), axis=1)


@triton.jit
def _load_pairs(ptr, g0, GROUPS: tl.constexpr, GPB: tl.constexpr, HALF: tl.constexpr):
    """A vector's even and odd entries of groups g0..g0+GPB−1, [GPB, HALF] fp32 each (0 past the last)."""
    gi = g0 + tl.arange(0, GPB)
    at = gi[:, None] * (2 * HALF) + 2 * tl.arange(0, HALF)[None, :]
    live = (gi < GROUPS)[:, None]
    even = tl.load(ptr + at, mask=live, other=0).to(tl.float32)
    odd = tl.load(ptr + at + 1, mask=live, other=0).to(tl.float32)
    return even, odd


@triton.jit
def _gate_up_kernel(
    x_ptr, rows_ptr, w_ptr, s_ptr, z_ptr, act_ptr, k, hidden, inter,
    GROUPS: tl.constexpr, GPB: tl.constexpr, BLOCK: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    p = tl.program_id(0)
    t = p // k
    row = tl.load(rows_ptr + p).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] act columns (< inter: inter % BLOCK == 0)
    w = w_ptr + row * (2 * inter) * (GROUPS * HALF)
    s = s_ptr + row * (2 * inter) * GROUPS
    z = z_ptr + row * (2 * inter) * GROUPS
    gate = tl.zeros((BLOCK,), dtype=tl.float32)
    up = tl.zeros((BLOCK,), dtype=tl.float32)
    for g0 in range(0, GROUPS, GPB):
        x_even, x_odd = _load_pairs(x_ptr + t * hidden, g0, GROUPS, GPB, HALF)
        gate += _groups_dot(w, s, z, n, g0, x_even, x_odd, GROUPS, GPB, HALF)
        up += _groups_dot(w, s, z, n + inter, g0, x_even, x_odd, GROUPS, GPB, HALF)
    act = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) · up
    tl.store(act_ptr + p * inter + n, act)


@triton.jit
def _down_kernel(
    act_ptr, rows_ptr, weights_ptr, w_ptr, s_ptr, z_ptr, out_ptr, hidden, inter,
    GROUPS: tl.constexpr, GPB: tl.constexpr, BLOCK: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    p = tl.program_id(0)
    row = tl.load(rows_ptr + p).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] output rows (< hidden)
    w = w_ptr + row * hidden * (GROUPS * HALF)
    s = s_ptr + row * hidden * GROUPS
    z = z_ptr + row * hidden * GROUPS
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for g0 in range(0, GROUPS, GPB):
        a_even, a_odd = _load_pairs(act_ptr + p * inter, g0, GROUPS, GPB, HALF)
        acc += _groups_dot(w, s, z, n, g0, a_even, a_odd, GROUPS, GPB, HALF)
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
        k, hidden, inter, GROUPS=hidden // GROUP, GPB=GROUPS_PER_STEP, BLOCK=block, HALF=GROUP // 2,
    )  # fmt: skip
    partial = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)
    _down_kernel[(pairs, hidden // block)](
        act, rows, weights.reshape(-1).contiguous(), pool["down_qweight"], pool["down_scales"],
        pool["down_zeros"], partial, hidden, inter, GROUPS=inter // GROUP, GPB=GROUPS_PER_STEP, BLOCK=block,
        HALF=GROUP // 2,
    )  # fmt: skip
    return partial.view(t, k, hidden).sum(1).to(x.dtype)
