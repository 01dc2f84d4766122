"""A QSA decode step's four independent kernels after its input projection as programs of one grid.

From the fused projection's output a decode step's QSA layer ran, one after another: the indexer's key
compression (`compress_step`: the raw key stored, the block's key written), the indexer's query norm and
rotary, the attention's query norm and rotary, and its key norm and rotary with the key and value stored
(`norm_rope`). None reads another's output, so here they are programs of one launch: row (token t) of the
grid is [compress, indexer heads, query heads, key heads], each program the body of its kernel
(`_compress_token`, `_norm_rope_head`). The block scores after it read the compressed keys and the indexer
queries; the attention reads the rest.

Why: three launches fewer a QSA layer, each its launch, wait and ramp for a few KB.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from common.kernels.config import KERNELS, KernelConfig
from common.kernels.norm_rope import Rotary, _norm_rope_head
from common.kernels.pdl import gdc_enter, launch
from common.kernels.qsa_indexer import KeyBlocks, _compress_token


class HeadNorm(NamedTuple):
    """Heads to normalise (weight (1 + w), eps) and rotate: x [T, H, D], last dim contiguous, D a power of
    two (rows and heads may be strided: views of the projection's output)."""

    x: torch.Tensor
    weight: torch.Tensor
    eps: float


@triton.jit
def _prologue_kernel(
    raw_ptr, new_ptr, new_stride, blocks_ptr, table_ptr, pos_ptr, rope_ptr, bw_ptr, inv_freq_ptr,
    table_width, page_size, b_eps, scaling, rot,
    iq_ptr, iq_stride_t, iq_stride_h, iq_w_ptr, iq_eps, iq_out_ptr, index_heads,
    q_ptr, q_stride_t, q_stride_h, q_w_ptr, q_eps, q_out_ptr, heads,
    k_ptr, k_stride_t, k_stride_h, k_w_ptr, k_eps, k_out_ptr, kv_heads,
    k_pages_ptr, v_ptr, v_stride_t, v_stride_h, v_pages_ptr, slots_ptr,
    R: tl.constexpr, DI: tl.constexpr, D: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(GDC)
    t, p = tl.program_id(0), tl.program_id(1)
    if p == 0:
        _compress_token(
            raw_ptr, new_ptr, new_stride, blocks_ptr, table_ptr, pos_ptr, rope_ptr, bw_ptr, inv_freq_ptr,
            table_width, page_size, b_eps, scaling, rot, t, R, DI,
        )  # fmt: skip
    elif p <= index_heads:
        _norm_rope_head(
            iq_ptr, iq_w_ptr, rope_ptr, inv_freq_ptr, iq_out_ptr, iq_stride_t, iq_stride_h, index_heads,
            iq_eps, rot, scaling, iq_out_ptr, iq_out_ptr, 0, 0, iq_out_ptr, pos_ptr, t, p - 1, DI, False,
        )  # fmt: skip
    elif p <= index_heads + heads:
        _norm_rope_head(
            q_ptr, q_w_ptr, rope_ptr, inv_freq_ptr, q_out_ptr, q_stride_t, q_stride_h, heads, q_eps, rot,
            scaling, q_out_ptr, q_out_ptr, 0, 0, q_out_ptr, pos_ptr, t, p - 1 - index_heads, D, False,
        )  # fmt: skip
    else:
        _norm_rope_head(
            k_ptr, k_w_ptr, rope_ptr, inv_freq_ptr, k_out_ptr, k_stride_t, k_stride_h, kv_heads, k_eps, rot,
            scaling, k_pages_ptr, v_ptr, v_stride_t, v_stride_h, v_pages_ptr, slots_ptr, t,
            p - 1 - index_heads - heads, D, True,
        )  # fmt: skip


def qsa_prologue(
    blocks: KeyBlocks,
    index_q: HeadNorm,
    q: HeadNorm,
    k: HeadNorm,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    positions: torch.Tensor,
    rope_positions: torch.Tensor,
    rotary: Rotary,
    kernels: KernelConfig = KERNELS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token per sequence: `compress_step(blocks, positions, rope_positions, rotary)`, and `norm_rope`
    of index_q, q and k at `rope_positions` (k's with `store`: k pages, v, v pages, slot mapping, as
    kv_store gives them) in one launch → the three rotated tensors (index_q's, q's, k's) [T, H, D] in their
    inputs' dtypes."""
    t = positions.shape[0]
    iq_heads, di = index_q.x.shape[1:]
    heads, dim = q.x.shape[1:]
    kv_heads = k.x.shape[1]
    k_pages, v, v_pages, slots = store
    assert rotary.rot_dim == 2 * rotary.inv_freq.numel() and blocks.new.stride(1) == 1
    assert blocks.new.shape == (t, di) and blocks.raw.shape[1] == di
    for head in (index_q, q, k):
        assert head.x.stride(2) == 1 and head.x.shape[0] == t, "x: [T, H, D], its last dim contiguous"
    assert k.x.shape[2] == dim and di & (di - 1) == 0 and dim & (dim - 1) == 0
    assert k_pages.shape[1:] == (kv_heads, dim) and v.shape == k.x.shape and v.stride(2) == 1
    outs = [torch.empty(h.x.shape, dtype=h.x.dtype, device=h.x.device) for h in (index_q, q, k)]
    head_args = [(h.x, h.x.stride(0), h.x.stride(1), h.weight, h.eps) for h in (index_q, q, k)]
    _prologue_kernel[(t, 1 + iq_heads + heads + kv_heads)](
        blocks.raw, blocks.new, blocks.new.stride(0), blocks.blocks, blocks.page_table, positions,
        rope_positions, blocks.weight, rotary.inv_freq, blocks.page_table.shape[1], blocks.page_size,
        blocks.eps, rotary.scaling, rotary.rot_dim,
        *head_args[0], outs[0], iq_heads, *head_args[1], outs[1], heads, *head_args[2], outs[2], kv_heads,
        k_pages, v, v.stride(0), v.stride(1), v_pages, slots,
        R=blocks.ratio, DI=di, D=dim, **launch(positions.device, kernels=kernels),
    )  # fmt: skip
    return outs[0], outs[1], outs[2]
