"""The MoE router's choice as one Triton kernel: softmax over experts (fp32), the top k, optional
renormalisation (common/model/moe.py `route`).

In torch the choice is ~5 kernels (softmax, topk, sum, divide, casts) per MoE layer. Program t holds token
t's E logits in registers and takes k rounds of max with its index (ties to the lower expert id, as torch.topk
does on CUDA for distinct values; equal router probabilities do not occur in practice).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.kernels.config import KERNELS, KernelConfig
from common.kernels.pdl import gdc_enter, launch


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, experts, K: tl.constexpr, KB: tl.constexpr, BLOCK: tl.constexpr,
    NORMALIZE: tl.constexpr, BF16: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(GDC)
    route_token(logits_ptr, weights_ptr, ids_ptr, experts, tl.program_id(0), K, KB, BLOCK, NORMALIZE, BF16)


@triton.jit
def route_token(
    logits_ptr, weights_ptr, ids_ptr, experts, t, K: tl.constexpr, KB: tl.constexpr, BLOCK: tl.constexpr,
    NORMALIZE: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """Token t's softmax and top-k; the weights in fp32, or with BF16 as bf16 bits (weights_ptr int16)."""
    e = tl.arange(0, BLOCK)
    live = e < experts
    x = tl.load(logits_ptr + t * experts + e, mask=live, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(live, p, -1.0)
    j = tl.arange(0, KB)
    ids = tl.zeros((KB,), dtype=tl.int64)
    weights = tl.zeros((KB,), dtype=tl.float32)
    for r in range(K):
        top, at = tl.max(p, axis=0, return_indices=True, return_indices_tie_break_left=True)  # one reduction
        ids = tl.where(j == r, at.to(tl.int64), ids)
        weights = tl.where(j == r, top, weights)
        p = tl.where(e == at, -1.0, p)
    if NORMALIZE:
        weights = weights / tl.sum(tl.where(j < K, weights, 0.0), axis=0)
    tl.store(ids_ptr + t * K + j, ids, mask=j < K)
    tl.store(weights_ptr + t * K + j, _bf16_bits(weights) if BF16 else weights, mask=j < K)


@triton.jit
def _bf16_bits(x):
    """fp32 x (finite) → its bf16 bits (int16), rounded to nearest even as torch casts (the interpreter
    casts fp32 to bf16 by truncation: rounded by hand)."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)


ROUTE_WARPS = 1
"""Warps a token's program: its k + 2 reductions over the E logits are then warp shuffles alone, where with
more warps each crosses shared memory behind a barrier."""


def route_fused(
    logits: torch.Tensor,
    top_k: int,
    normalize: bool,
    dtype: torch.dtype = torch.float32,
    kernels: KernelConfig = KERNELS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route`'s result — (weights [T, k] in `dtype`, ids [T, k] int64) — from router logits [T, E]. The
    weights are computed in fp32; bf16 ones are rounded in the kernel (no cast kernel after it), others
    cast after it."""
    t, experts = logits.shape
    bf16 = dtype == torch.bfloat16
    weights = torch.empty((t, top_k), dtype=dtype if bf16 else torch.float32, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    _route_kernel[(t,)](
        logits.contiguous(), as_written(weights, bf16), ids, experts, K=top_k,
        KB=triton.next_power_of_2(top_k), BLOCK=triton.next_power_of_2(experts), NORMALIZE=normalize,
        BF16=bf16, num_warps=ROUTE_WARPS, **launch(logits.device, kernels=kernels),
    )  # fmt: skip
    return weights.to(dtype), ids


@triton.jit
def _replay_kernel(
    trace_ids_ptr, trace_w_ptr, cursor_ptr, ids_ptr, weights_ptr, rows, layers, layer, tokens,
    K: tl.constexpr, KB: tl.constexpr, TB: tl.constexpr, ADVANCE: tl.constexpr, BF16: tl.constexpr,
    GDC: tl.constexpr,
):  # fmt: skip
    """Tokens [TB·pid, TB·(pid+1)) of the call (every token with ADVANCE: one program, which then moves the
    cursor on, as no other program reads it)."""
    gdc_enter(GDC)
    first = tl.program_id(0) * TB
    last = tokens if ADVANCE else first + TB
    replay_tokens(
        trace_ids_ptr, trace_w_ptr, cursor_ptr, ids_ptr, weights_ptr, rows, layers, layer, tokens, first,
        last, K, KB, TB, ADVANCE, BF16,
    )  # fmt: skip


@triton.jit
def replay_tokens(
    trace_ids_ptr, trace_w_ptr, cursor_ptr, ids_ptr, weights_ptr, rows, layers, layer, tokens, first, last,
    K: tl.constexpr, KB: tl.constexpr, TB: tl.constexpr, ADVANCE: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """Trace layer `layer`'s rows for tokens [first, last) of the call's `tokens`, from row cursor[layer] on
    (cycling over `rows`); with ADVANCE (the program that handles every token) the cursor then moves on by
    `tokens`. With BF16 the weights as bf16 bits (`_bf16_bits`)."""
    base = tl.load(cursor_ptr + layer)
    j = tl.arange(0, KB)
    for t0 in range(first, last, TB):
        t = t0 + tl.arange(0, TB)  # [TB]
        live = (t < tokens)[:, None] & (j < K)[None, :]  # [TB, KB]
        row = ((t + base) % rows).to(tl.int64)
        at = (row[:, None] * layers + layer) * K + j[None, :]
        out = t[:, None] * K + j[None, :]
        tl.store(ids_ptr + out, tl.load(trace_ids_ptr + at, mask=live).to(tl.int64), mask=live)
        weight = tl.load(trace_w_ptr + at, mask=live)  # fp32
        if BF16:  # weights_ptr: the bf16 weights' bits (int16)
            tl.store(weights_ptr + out, _bf16_bits(weight), mask=live)
        else:
            tl.store(weights_ptr + out, weight, mask=live)
    if ADVANCE:
        tl.store(cursor_ptr + layer, base + tokens)


def as_written(weights: torch.Tensor, bf16: bool) -> torch.Tensor:
    """The routing weights as the kernels write them: bf16 ones as their bits (int16, `_bf16_bits`)."""
    return weights.view(torch.int16) if bf16 else weights


REPLAY_ONE_PROGRAM = 256
"""Calls of up to this many tokens (decode passes) run as one program that also advances the cursor: two
small kernels fewer a MoE layer (the cursor's add and the weights' cast). Longer ones (prefill chunks) run a
program per 16 tokens, and a torch add advances the cursor after them."""


def replay_rows(
    trace_ids: torch.Tensor,
    trace_weights: torch.Tensor,
    cursor: torch.Tensor,
    layer: int,
    tokens: int,
    dtype: torch.dtype = torch.float32,
    kernels: KernelConfig = KERNELS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing replay's rows for `tokens` tokens of trace layer `layer` from row cursor[layer] on
    (cycling): (ids [T, k] int64, weights [T, k] in `dtype`: fp32 or bf16 in the kernel, others cast after
    it); cursor[layer] advanced by `tokens`."""
    rows, layers, k = trace_ids.shape
    ids = torch.empty((tokens, k), dtype=torch.int64, device=trace_ids.device)
    bf16 = dtype == torch.bfloat16
    weights = torch.empty((tokens, k), dtype=dtype if bf16 else torch.float32, device=trace_ids.device)
    advance, tb = tokens <= REPLAY_ONE_PROGRAM, 16
    _replay_kernel[(1 if advance else triton.cdiv(tokens, tb),)](
        trace_ids, trace_weights, cursor, ids, as_written(weights, bf16), rows, layers,
        layer, tokens, K=k, KB=triton.next_power_of_2(k), TB=tb, ADVANCE=advance, BF16=bf16,
        **launch(trace_ids.device, kernels=kernels),
    )  # fmt: skip
    if not advance:
        cursor[layer].add_(tokens)
    return ids, weights.to(dtype)
