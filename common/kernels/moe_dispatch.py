"""A MoE block's decode dispatch in one Triton kernel: the router's choice, the routing replay and the shared
expert's down projection as programs of one grid.

All three read only the block's input projection (the replay not that), and the routed experts need the
first two: in one grid the step waits for the slowest alone, not their sum. Program (t, 0) is token t's
softmax and top-k (routing.route_token); with a replay, program (0, 1) hands out the trace's rows for every
token and advances the cursor (routing.replay_tokens; programs (t > 0, 1) only wait); the rest are the shared
expert's output blocks (gated_mlp.swiglu_down_block), loading their weight tiles before the programmatic
wait. With a replay the router still chooses; the experts use its rows. Results as the three
kernels': experts and replayed rows bit for bit, routing weights and shared expert to rounding. The routed
experts' first kernel reads the rows after its programmatic wait (SparseMoeBlock passes `settled` False).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.kernels.config import KERNELS, KernelConfig
from common.kernels.gated_mlp import swiglu_down_block
from common.kernels.pdl import gdc_enter, launch
from common.kernels.routing import REPLAY_ONE_PROGRAM, as_written, replay_tokens, route_token

WARPS = 4
"""Warps a program: the shared expert's 8 × I weight tile a program in 128 threads outweighs the router's
reductions crossing shared memory (at 1 warp they are warp shuffles alone, routing.ROUTE_WARPS)."""
SHARED_BLOCK = 8
"""Shared-expert output rows a program (swiglu_down's default)."""

Replay = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]
"""A routing replay's rows on the device: (trace ids [rows, layers, k], trace weights [rows, layers, k] fp32,
cursors [layers] int64, the trace layer), as RoutingReplayer.device_rows gives them."""
Shared = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""A shared expert's second half: (gate [T, I], up [T, I] — views with unit column stride —, down [H, I])."""


@triton.jit
def _dispatch_kernel(
    logits_ptr, weights_ptr, ids_ptr, experts,
    trace_ids_ptr, trace_w_ptr, cursor_ptr, replay_ids_ptr, replay_w_ptr, trace_rows, trace_layers, layer,
    tokens, gate_ptr, up_ptr, down_ptr, shared_ptr, hidden, gate_stride, up_stride,
    K: tl.constexpr, KB: tl.constexpr, E_BLOCK: tl.constexpr, NORMALIZE: tl.constexpr, BF16: tl.constexpr,
    REPLAY: tl.constexpr, SHARED: tl.constexpr, INTER: tl.constexpr, BLOCK: tl.constexpr,
    I_BLOCK: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    t, j = tl.program_id(0), tl.program_id(1)
    if j == 0:
        gdc_enter(GDC)
        route_token(logits_ptr, weights_ptr, ids_ptr, experts, t, K, KB, E_BLOCK, NORMALIZE, BF16)
    elif j > REPLAY:  # the shared expert's blocks (REPLAY 0 or 1)
        if SHARED:
            swiglu_down_block(
                gate_ptr, up_ptr, down_ptr, shared_ptr, hidden, gate_stride, up_stride, t, j - 1 - REPLAY,
                INTER, BLOCK, I_BLOCK, GDC,
            )  # fmt: skip
    else:  # the replay's programs (none without one: then its code is not even compiled)
        gdc_enter(GDC)
        if REPLAY:  # noqa: SIM102  (a static branch around a runtime one)
            if t == 0:
                replay_tokens(
                    trace_ids_ptr, trace_w_ptr, cursor_ptr, replay_ids_ptr, replay_w_ptr, trace_rows,
                    trace_layers, layer, tokens, 0, tokens, K, KB, 16, True, BF16,
                )  # fmt: skip


def moe_dispatch(
    logits: torch.Tensor,
    top_k: int,
    normalize: bool,
    dtype: torch.dtype = torch.float32,
    replay: Replay | None = None,
    shared: Shared | None = None,
    kernels: KernelConfig = KERNELS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """From router logits [T, E]: (weights [T, k] in `dtype`, ids [T, k] int64) as route_fused gives them —
    or, with `replay`, as replay_rows gives them (cursor advanced by T) —, and with `shared` its
    down · (silu(gate) · up) [T, H] in gate's dtype as swiglu_down gives it (None without)."""
    t, experts = logits.shape
    assert t <= REPLAY_ONE_PROGRAM, f"{t} tokens: at most {REPLAY_ONE_PROGRAM}"
    device = logits.device
    bf16 = dtype == torch.bfloat16

    def choice() -> tuple[torch.Tensor, torch.Tensor]:
        weights = torch.empty((t, top_k), dtype=dtype if bf16 else torch.float32, device=device)
        return weights, torch.empty((t, top_k), dtype=torch.int64, device=device)

    weights, ids = choice()  # the router's
    used_weights, used_ids = choice() if replay is not None else (weights, ids)  # what the experts use
    trace_ids, trace_weights, cursor, layer = replay if replay is not None else (ids, weights, ids, 0)
    gate, up, down = shared if shared is not None else (logits, logits, logits)
    hidden, inter = down.shape if shared is not None else (0, 1)
    assert shared is None or (gate.stride(1) == 1 and up.stride(1) == 1 and down.is_contiguous())
    out = torch.empty((t, hidden), dtype=gate.dtype, device=device) if shared is not None else None
    grid = (t, 1 + int(replay is not None) + triton.cdiv(hidden, SHARED_BLOCK))
    _dispatch_kernel[grid](
        logits.contiguous(), as_written(weights, bf16), ids, experts, trace_ids, trace_weights, cursor,
        used_ids, as_written(used_weights, bf16), *trace_ids.shape[:2], layer, t, gate, up, down,
        logits if out is None else out, hidden, gate.stride(0), up.stride(0), K=top_k,
        KB=triton.next_power_of_2(top_k), E_BLOCK=triton.next_power_of_2(experts), NORMALIZE=normalize,
        BF16=bf16, REPLAY=int(replay is not None), SHARED=shared is not None, INTER=inter, BLOCK=SHARED_BLOCK,
        I_BLOCK=min(1024, triton.next_power_of_2(inter)), num_warps=WARPS, **launch(device, kernels=kernels),
    )  # fmt: skip
    return used_weights.to(dtype), used_ids, out
