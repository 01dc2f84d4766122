"""Prefill MoE over the dense decode kernels' formats (bf16, fp8, the 4-bit floats, published int4) in their
pool rows: (token, choice) pairs grouped by expert into blocks (`group_pairs`, the int4 kernels'), each
block's products tiled GEMMs on tensor cores.

The structure of moe_int4_grouped.py: gate/up over every block (SiLU · up fused, act [P, I]), then down over
the pairs of at most MOE_DOWN_TOKENS tokens at a time, each row weighted by its routing weight and a token's
k rows summed. Each step of 128 inputs of a weight tile is decoded in registers by moe_dense.py's
`weight_tile` (fp32, rounded once to the activations' dtype) and multiplied by `tl.dot`; NVFP4s' global
scales are applied to the accumulators.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.kernels.config import MOE_DOWN_TOKENS
from common.kernels.moe_dense import (
    BK,
    dense_layout,
    dense_operands,
    global_scale,
    matrix_offsets,
    weight_tile,
)
from common.kernels.moe_int4_grouped import GROUPED, GroupedConfig, down_slices, group_pairs


@triton.jit
def _block(rows_ptr, pairs_ptr, block_expert_ptr, BM: tl.constexpr):
    """This program's block: (its expert's pool row, its pairs [BM] (−1: padding), their mask); row −1
    for an unused block."""
    b = tl.program_id(0)
    expert = tl.load(block_expert_ptr + b)
    row = tl.load(rows_ptr + tl.maximum(expert, 0)).to(tl.int64)
    pairs = tl.load(pairs_ptr + b * BM + tl.arange(0, BM))
    return tl.where(expert < 0, -1, row), pairs, pairs >= 0


@triton.jit
def _a_tile(a_ptr, a_rows, a_live, width, k0):
    """Rows `a_rows` of a [., width], inputs k0 .. k0 + BK: [BM, BK] (0 in dead rows and past `width`)."""
    c = k0 + tl.arange(0, BK)
    at = a_rows[:, None].to(tl.int64) * width + c[None, :]
    return tl.load(a_ptr + at, mask=a_live[:, None] & (c < width)[None, :], other=0.0)


@triton.jit
def _grouped_gate_up_kernel(
    x_ptr, pairs_ptr, block_expert_ptr, rows_ptr, w_ptr, s_ptr, z_ptr, g_ptr, act_ptr, k, s_rows, s_cols,
    hidden: tl.constexpr, inter: tl.constexpr, FMT: tl.constexpr, PARAM: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    row, pairs, live = _block(rows_ptr, pairs_ptr, block_expert_ptr, BM)
    if row < 0:
        return
    tokens = tl.where(live, pairs // k, 0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN] act columns
    n_live = n < inter
    w_off, s_off, z_off = matrix_offsets(row, 2 * inter, hidden, s_rows, s_cols, FMT)
    w, s, z, a = w_ptr + w_off, s_ptr + s_off, z_ptr + z_off, g_ptr + row * 2 * hidden  # a: GPTQ's g_idx
    gate = tl.zeros((BM, BN), dtype=tl.float32)
    up = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in tl.range(0, hidden, BK, num_stages=STAGES):
        x = _a_tile(x_ptr, tokens, live, hidden, k0)  # gathered once for gate and up
        wg = weight_tile(w, s, z, a, n, n_live, k0, hidden, 2 * inter, s_cols, FMT, PARAM)  # [BN, BK]
        gate = tl.dot(x, tl.trans(wg.to(x.dtype)), gate, input_precision=PRECISION)
        wu = weight_tile(w, s, z, a + hidden, n + inter, n_live, k0, hidden, 2 * inter, s_cols, FMT, PARAM)
        up = tl.dot(x, tl.trans(wu.to(x.dtype)), up, input_precision=PRECISION)
    if FMT == 2 or FMT == 4:  # the NVFP4s' global scales: gate's, up's
        gate *= global_scale(g_ptr, 2 * row, FMT)
        up *= global_scale(g_ptr, 2 * row + 1, FMT)
    act = gate / (1.0 + tl.exp(-gate)) * up
    at = tl.where(live, pairs, 0)[:, None] * inter + n[None, :]
    tl.store(act_ptr + at, act.to(act_ptr.dtype.element_ty), mask=live[:, None] & n_live[None, :])


@triton.jit
def _grouped_down_kernel(
    act_ptr, pairs_ptr, block_expert_ptr, rows_ptr, weights_ptr, w_ptr, s_ptr, z_ptr, g_ptr, out_ptr,
    s_rows, s_cols,
    hidden: tl.constexpr, inter: tl.constexpr, FMT: tl.constexpr, PARAM: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    row, pairs, live = _block(rows_ptr, pairs_ptr, block_expert_ptr, BM)
    if row < 0:
        return
    safe = tl.where(live, pairs, 0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN] output columns
    n_live = n < hidden
    w_off, s_off, z_off = matrix_offsets(row, hidden, inter, s_rows, s_cols, FMT)
    w, s, z, a = w_ptr + w_off, s_ptr + s_off, z_ptr + z_off, g_ptr + row * inter  # a: GPTQ's g_idx
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in tl.range(0, inter, BK, num_stages=STAGES):
        act = _a_tile(act_ptr, safe, live, inter, k0)
        wd = weight_tile(w, s, z, a, n, n_live, k0, inter, hidden, s_cols, FMT, PARAM)
        acc = tl.dot(act, tl.trans(wd.to(act.dtype)), acc, input_precision=PRECISION)
    if FMT == 2 or FMT == 4:  # the NVFP4s' global scale
        acc *= global_scale(g_ptr, row, FMT)
    acc = acc * tl.load(weights_ptr + safe, mask=live, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + safe[:, None].to(tl.int64) * hidden + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=live[:, None] & n_live[None, :])


def moe_dense_grouped(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    rows: torch.Tensor,
    pool: dict[str, torch.Tensor],
    config: GroupedConfig = GROUPED,
    down_tokens: int = MOE_DOWN_TOKENS,
    param: int = 0,
) -> torch.Tensor:
    """Prefill: Σ_j topk_weights[t, j] · SwiGLU expert topk_ids[t, j] (x[t]) → [T, H] in x's dtype, with
    expert e's weights at pool row rows[e] ([E] int64) in any format moe_dense_decode reads but trellis codes
    (its `pool` and `param`); any H and I the format takes. Blocks of `config.block_m` pairs, `config.block_n`
    output columns a program; down over at most `down_tokens` tokens at a time. Each pair's term is rounded
    to x's dtype and the k terms of a token summed in fp32 (in choice order)."""
    t, k = topk_ids.shape
    fmt, hidden, inter = dense_layout(pool)
    bm, bn = config.block_m, config.block_n
    pairs, block_expert = group_pairs(topk_ids, rows.numel(), bm)
    x = x.contiguous()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 models: no TF32 rounding
    launch = {
        "num_warps": config.num_warps,
        "STAGES": config.stages,
        "BM": bm,
        "BN": bn,
        "PRECISION": precision,
    }
    shape = {"hidden": hidden, "inter": inter, "FMT": fmt, "PARAM": param}
    act = torch.empty((t * k, inter), dtype=x.dtype, device=x.device)
    w, scale, zeros, aux, s_rows, s_cols = dense_operands(pool, "gate_up", fmt)
    _grouped_gate_up_kernel[(block_expert.numel(), triton.cdiv(inter, bn))](
        x, pairs, block_expert, rows, w, scale, zeros, aux, act, k, s_rows, s_cols, **shape, **launch
    )
    weights = topk_weights.reshape(-1).contiguous()
    out = torch.empty((t, hidden), dtype=x.dtype, device=x.device)
    w, scale, zeros, aux, s_rows, s_cols = dense_operands(pool, "down", fmt)
    slices = down_slices(topk_ids, rows.numel(), bm, down_tokens, (pairs, block_expert))
    for start, end, pairs, block_expert in slices:
        rows_out = torch.empty(((end - start) * k, hidden), dtype=x.dtype, device=x.device)
        _grouped_down_kernel[(block_expert.numel(), triton.cdiv(hidden, bn))](
            act[start * k : end * k], pairs, block_expert, rows, weights[start * k : end * k],
            w, scale, zeros, aux, rows_out, s_rows, s_cols, **shape, **launch,
        )  # fmt: skip
        out[start:end] = rows_out.view(end - start, k, hidden).sum(1, dtype=torch.float32)
    return out
