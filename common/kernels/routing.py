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

from common.kernels import arrival
from common.kernels.arrival import arrive
from common.kernels.pdl import gdc_enter, launch


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, experts,
    trace_ids_ptr, trace_w_ptr, cursor_ptr, count_ptr, r_ids_ptr, r_weights_ptr, rows, layers, layer, tokens,
    K: tl.constexpr, KB: tl.constexpr, BLOCK: tl.constexpr, NORMALIZE: tl.constexpr, BF16: tl.constexpr,
    REPLAY: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """One token's softmax and top-k; the weights in fp32, or with BF16 as bf16 bits (weights_ptr int16).
    With REPLAY also the replay's row for the token (`_replay_row`)."""
    gdc_enter(GDC)
    if REPLAY:  # read before the choice's stores: the cursor moves on once every program has read it
        base = tl.load(cursor_ptr + layer)
        token = tl.program_id(0) + tl.arange(0, 1)  # [1]
        _replay_rows(trace_ids_ptr, trace_w_ptr, r_ids_ptr, r_weights_ptr, base, rows, layers, layer, token,
                     tokens, K, KB, BF16)  # fmt: skip
    t = tl.program_id(0)
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
    if REPLAY:  # noqa: SIM102 (a constexpr: nothing of the replay compiled without it)
        if arrive(count_ptr, tokens):  # the last program: every program has read the cursor
            tl.store(cursor_ptr + layer, base + tokens)


@triton.jit
def _replay_rows(
    trace_ids_ptr, trace_w_ptr, ids_ptr, weights_ptr, base, rows, layers, layer, t, tokens,
    K: tl.constexpr, KB: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """Tokens t [TB]'s choices (those < tokens) from the trace's rows (t + base) % rows of trace layer
    `layer` ([rows, layers, K] ids int32, weights fp32): ids int64, weights fp32 or with BF16 as bf16 bits."""
    j = tl.arange(0, KB)
    live = (t < tokens)[:, None] & (j < K)[None, :]  # [TB, KB]
    row = ((t + base) % rows).to(tl.int64)
    at = (row[:, None] * layers + layer) * K + j[None, :]
    out = t[:, None] * K + j[None, :]
    tl.store(ids_ptr + out, tl.load(trace_ids_ptr + at, mask=live).to(tl.int64), mask=live)
    weight = tl.load(trace_w_ptr + at, mask=live)
    tl.store(weights_ptr + out, _bf16_bits(weight) if BF16 else weight, mask=live)


@triton.jit
def _bf16_bits(x):
    """fp32 x (finite) → its bf16 bits (int16), rounded to nearest even as torch casts (the interpreter
    casts fp32 to bf16 by truncation: rounded by hand)."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)


ROUTE_WARPS = 1
"""Warps a token's program: its k + 2 reductions over the E logits are then warp shuffles alone, where with 4
warps each crossed shared memory behind a barrier (~4.8 µs a call in decode-allfit-profile.txt at 81a85af,
48 a step, for ~0.5 µs of arithmetic)."""


def route_fused(
    logits: torch.Tensor,
    top_k: int,
    normalize: bool,
    dtype: torch.dtype = torch.float32,
    replay: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route`'s result — (weights [T, k] in `dtype`, ids [T, k] int64) — from router logits [T, E]. The
    weights are computed in fp32; bf16 ones are rounded in the kernel (no cast kernel after it), others
    cast after it.

    `replay` (a routing replay's trace ids [R, L, k] int32, weights [R, L, k] fp32, cursors [L] int64 and
    trace layer: RoutingReplayer.kernel_rows): the same kernel also hands out the trace's rows from the
    layer's cursor on, and moves the cursor on; those are returned, as `replay_rows` returns them. The
    router's own choice is still made and written (a server's router does that work), one kernel fewer a
    MoE layer than the router's and the replay's."""
    t, experts = logits.shape
    bf16 = dtype == torch.bfloat16
    weights = torch.empty((t, top_k), dtype=dtype if bf16 else torch.float32, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    r_weights, r_ids = (torch.empty_like(weights), torch.empty_like(ids)) if replay else (weights, ids)
    trace_ids, trace_w, cursor, layer = replay or (ids, weights, ids, 0)  # (unread without a replay)
    counts = arrival.counters(logits.device, 1) if replay else ids
    _route_kernel[(t,)](
        logits.contiguous(), weights.view(torch.int16) if bf16 else weights, ids, experts, trace_ids, trace_w,
        cursor, counts, r_ids, r_weights.view(torch.int16) if bf16 else r_weights, trace_ids.shape[0],
        trace_ids.shape[1] if replay else 1, layer, t, K=top_k, KB=triton.next_power_of_2(top_k),
        BLOCK=triton.next_power_of_2(experts), NORMALIZE=normalize, BF16=bf16, REPLAY=replay is not None,
        num_warps=ROUTE_WARPS, **launch(logits.device),
    )  # fmt: skip
    return r_weights.to(dtype), r_ids


@triton.jit
def _replay_kernel(
    trace_ids_ptr, trace_w_ptr, cursor_ptr, ids_ptr, weights_ptr, rows, layers, layer, tokens,
    K: tl.constexpr, KB: tl.constexpr, TB: tl.constexpr, ADVANCE: tl.constexpr, BF16: tl.constexpr,
    GDC: tl.constexpr,
):  # fmt: skip
    """Tokens [TB·pid, TB·(pid+1)) of the call (every token with ADVANCE: one program, which then moves the
    cursor on, as no other program reads it); with BF16 the weights as bf16 bits (`_bf16_bits`)."""
    gdc_enter(GDC)
    base = tl.load(cursor_ptr + layer)
    first = tl.program_id(0) * TB
    last = tokens if ADVANCE else first + TB
    for t0 in range(first, last, TB):
        _replay_rows(trace_ids_ptr, trace_w_ptr, ids_ptr, weights_ptr, base, rows, layers, layer,
                     t0 + tl.arange(0, TB), tokens, K, KB, BF16)  # fmt: skip
    if ADVANCE:
        tl.store(cursor_ptr + layer, base + tokens)


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
        trace_ids, trace_weights, cursor, ids, weights.view(torch.int16) if bf16 else weights, rows, layers,
        layer, tokens, K=k, KB=triton.next_power_of_2(k), TB=tb, ADVANCE=advance, BF16=bf16,
        **launch(trace_ids.device),
    )  # fmt: skip
    if not advance:
        cursor[layer].add_(tokens)
    return ids, weights.to(dtype)
