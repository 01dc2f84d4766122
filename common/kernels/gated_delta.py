"""One decode step of Gated DeltaNet's recurrence as one Triton kernel, the state updated in place.

The torch step (common/model/qwen4_exp/delta_rule.py `recurrent_step`, with the gates GatedDeltaNet computes
around it and the slot gather/scatter) is ~35 small kernels per layer. Here program (token t, value head h,
block of BV value columns) loads its query and key head (key head h // (Hv/Hk): the grouped heads are not
repeated in memory), L2-normalises them, forms the gates β = σ(b) and g = −exp(A_log)·softplus(a + dt_bias),
and applies, with S the [Dk, BV] block of the state of sequence slot[t]:

    S ← exp(g)·S;   S ← S + k ⊗ β(v − Sᵀk);   o = Sᵀq  (q scaled by Dk^-1/2)

in fp32. Each block of value columns is independent (the update of column j reads only column j), so the
state never leaves the program between its load and its store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.kernels.config import KERNELS, KernelConfig
from common.kernels.pdl import gdc_enter, launch


@triton.jit
def _gated_delta_step_kernel(
    qkv_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, slots_ptr, out_ptr,
    qkv_stride, a_stride, b_stride, heads_v, group, key_dim,
    DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, EARLY_GATES: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    t, h = tl.program_id(0), tl.program_id(1)
    # Read before the wait (pdl.py: only the kernel just before may still run): the slots, the state (this
    # kernel's own, a step ago) and, with EARLY_GATES, the gate projections (the input projection's, with
    # conv_step between; without, the kernel just before wrote them: copies, or the GEMV whose epilogue ran
    # the conv).
    at, s, cols = state_block(state_ptr, slots_ptr, heads_v, DK, DV, BV)
    if EARLY_GATES:
        g, beta = gates(a_ptr + t * a_stride + h, b_ptr + t * b_stride + h, a_log_ptr + h, dt_bias_ptr + h)
    gdc_enter(GDC)  # q, k, v: the causal conv's output, the kernel just before
    if not EARLY_GATES:
        g, beta = gates(a_ptr + t * a_stride + h, b_ptr + t * b_stride + h, a_log_ptr + h, dt_bias_ptr + h)
    row = qkv_ptr + t * qkv_stride
    kh, d = h // group, tl.arange(0, DK)
    q = tl.load(row + kh * DK + d).to(tl.float32)
    k = tl.load(row + key_dim + kh * DK + d).to(tl.float32)
    v = tl.load(row + 2 * key_dim + h * DV + cols).to(tl.float32)
    tl.store(out_ptr + (t * heads_v + h) * DV + cols, delta_rule(at, s, q, k, v, g, beta, DK))


@triton.jit
def state_block(state_ptr, slots_ptr, heads_v, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
    """Program (token t, value head h, block of BV value columns)'s state block: (its pointers [DK, BV], its
    values, its columns [BV])."""
    t, h = tl.program_id(0), tl.program_id(1)
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    d = tl.arange(0, DK)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    at = state_ptr + ((slot * heads_v + h) * DK + d[:, None]) * DV + cols[None, :]
    return at, tl.load(at), cols


@triton.jit
def delta_rule(at, s, q, k, v, g, beta, DK: tl.constexpr):
    """The gated delta rule on state block s [DK, BV] (stored back at `at`) with q, k [DK], v [BV] (fp32, not
    yet normalised) → o [BV]."""
    s = s * tl.exp(g)
    q = q * tl.math.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * (1.0 / tl.sqrt(DK * 1.0))
    k = k * tl.math.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    predicted = tl.sum(s * k[:, None], axis=0)  # [BV]
    s = s + k[:, None] * ((v - predicted) * beta)[None, :]
    tl.store(at, s)
    return tl.sum(s * q[:, None], axis=0)


@triton.jit
def gates(a_at, b_at, a_log_at, dt_bias_at):
    """Head h's decay g = −exp(A_log)·softplus(a + dt_bias) and write strength β = σ(b), fp32."""
    beta = tl.sigmoid(tl.load(b_at).to(tl.float32))
    x = tl.load(a_at).to(tl.float32) + tl.load(dt_bias_at).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # torch's softplus threshold
    return -tl.exp(tl.load(a_log_at).to(tl.float32)) * softplus, beta


def state_dims(state: torch.Tensor) -> tuple[int, int, int]:
    """(Hv, Dk, Dv) of a recurrent state [S, Hv, Dk, Dv], whose head dims the kernels need powers of two."""
    _, heads_v, dk, dv = state.shape
    if dk & (dk - 1) or dv & (dv - 1):
        raise ValueError(f"head dims must be powers of two, got Dk={dk}, Dv={dv}")
    return heads_v, dk, dv


def gated_delta_step(
    qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    heads_k: int,
    block_v: int = 32,
    gates_settled: bool = True,
    kernels: KernelConfig = KERNELS,
) -> torch.Tensor:
    """One token per sequence: qkv [T, 2·Hk·Dk + Hv·Dv] (the convolved, activated projections: q, k, v
    heads back to back), a, b [T, Hv] (the gate projections, before softplus / sigmoid; rows may be strided),
    a_log, dt_bias [Hv],
    state [S, Hv, Dk, Dv] fp32 (sequence t's at slots[t], updated in place) → o [T, Hv, Dv] fp32.
    `gates_settled`: a and b are not the output of the kernel just before (in programmatic launch they may be
    read before the wait); False where that kernel wrote them (the projection with the conv in its epilogue,
    gemv.ConvStep)."""
    t = qkv.shape[0]
    qkv = qkv.contiguous()  # a conv's output may come transposed
    heads_v, dk, dv = state_dims(state)
    block_v = min(block_v, dv)
    out = torch.empty((t, heads_v, dv), dtype=torch.float32, device=qkv.device)
    in_place = a.stride(1) == 1 and b.stride(1) == 1  # rows of a fused projection: read in place, no copy
    a, b = (a, b) if in_place else (a.contiguous(), b.contiguous())
    grid = (t, heads_v, dv // block_v)
    _gated_delta_step_kernel[grid](
        qkv, a, b, a_log, dt_bias, state, slots, out, qkv.stride(0), a.stride(0), b.stride(0), heads_v,
        heads_v // heads_k, heads_k * dk, DK=dk, DV=dv, BV=block_v, EARLY_GATES=in_place and gates_settled,
        **launch(qkv.device, trigger_first=True, kernels=kernels),  # the next kernel: the gated norm
    )  # fmt: skip
    return out
