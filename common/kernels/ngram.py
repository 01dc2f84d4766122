"""A decode step's n-gram hashing for PLE (common/model/ngram.py) as one Triton kernel.

In torch a step's hashing is ~50 small kernels (shifted histories with their end-of-sequence cuts, the
multiply-xor mixing per n-gram order, the remainders, the padding, the context's update) for a few integers a
lane. Here one program per lane reads its n−1 tokens of context and its new token,
writes the table rows of every head, and shifts the context.

The values are those of `ngram_ids`: a token times its position's multiplier stays below 2⁶³ (the
multipliers are bounded by 2⁶³ / vocab), so the mixed value is non-negative and Triton's remainder is
torch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.kernels.config import KERNELS, KernelConfig
from common.kernels.hash_spec import HashSpec, spec_tensors
from common.kernels.pdl import gdc_enter, launch


@triton.jit
def _ngram_step_kernel(
    context_ptr, context_stride, tokens_ptr, slots_ptr, mult_ptr, sizes_ptr, offsets_ptr, out_ptr, eos,
    N: tl.constexpr, HEADS_PER_ORDER: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(GDC)
    lane = tl.program_id(0)
    row = context_ptr + tl.load(slots_ptr + lane) * context_stride
    token = tl.load(tokens_ptr + lane)
    heads: tl.constexpr = (N - 1) * HEADS_PER_ORDER
    mixed = token * tl.load(mult_ptr)
    cut = token != token  # False: no end-of-sequence between the token and the history read so far
    for shift in tl.static_range(1, N):  # history[-shift], nearest first; an EOS cuts what lies before it
        past = tl.load(row + (N - 1 - shift))
        cut = cut | (past == eos)
        mixed = mixed ^ (tl.where(cut, eos, past) * tl.load(mult_ptr + shift))
        for j in tl.static_range(HEADS_PER_ORDER):  # the order shift + 1 is complete: its heads
            head = (shift - 1) * HEADS_PER_ORDER + j
            size, offset = tl.load(sizes_ptr + head), tl.load(offsets_ptr + head)
            tl.store(out_ptr + lane * heads + head, mixed % size + offset)
    for i in tl.static_range(N - 2):  # the context moves on by one: its last n − 1 tokens, raw
        tl.store(row + i, tl.load(row + i + 1))
    tl.store(row + (N - 2), token)


def ngram_step(
    spec: HashSpec,
    context: torch.Tensor,
    tokens: torch.Tensor,
    slots: torch.Tensor,
    kernels: KernelConfig = KERNELS,
) -> torch.Tensor:
    """Table rows [B, heads] of each lane's new token `tokens` [B] after its context `context[slots[b]]`
    ([S, n−1] int64, updated in place) — `ngram_ids` of the history context ++ token, for its last token."""
    if spec.ngram_size < 2:
        raise ValueError("n-gram hashing needs an n-gram size of at least 2")
    assert context.stride(1) == 1, "each slot's context must be contiguous"
    mult, sizes, offsets = spec_tensors(spec, tokens.device)
    out = torch.empty((tokens.shape[0], spec.num_heads), dtype=torch.int64, device=tokens.device)
    if tokens.shape[0]:
        _ngram_step_kernel[(tokens.shape[0],)](
            context, context.stride(0), tokens, slots, mult, sizes, offsets, out, spec.eos_token_id,
            N=spec.ngram_size, HEADS_PER_ORDER=spec.heads_per_ngram, **launch(tokens.device, kernels=kernels),
        )  # fmt: skip
    return out
