"""Gather rows of a host-resident, GPU-mapped table straight into device memory (one Triton kernel).

Each program copies one row: the GPU reads the row over PCIe through the mapping, so only the rows a step
needs ever cross the link and the host never synchronises. fp8 rows are scaled by their shard's scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_rows_kernel(
    table_ptr, ids_ptr, scale_ptr, out_ptr, dim, shard_rows, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr
):
    pid = tl.program_id(0)
    row = tl.load(ids_ptr + pid).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    vals = tl.load(table_ptr + row * dim + offs, mask=mask).to(tl.float32)
    if HAS_SCALE:
        vals = vals * tl.load(scale_ptr + row // shard_rows)
    tl.store(out_ptr + pid.to(tl.int64) * dim + offs, vals.to(out_ptr.dtype.element_ty), mask=mask)


def gather_rows(
    table: torch.Tensor,
    ids: torch.Tensor,
    dtype: torch.dtype,
    scales: torch.Tensor | None = None,
    shard_rows: int = 1,
) -> torch.Tensor:
    """table [R, d] (mapped host memory); ids [...] int64 on the GPU → [..., d] in `dtype` on the GPU."""
    flat = ids.reshape(-1).contiguous()
    dim = table.shape[1]
    out = torch.empty((flat.numel(), dim), dtype=dtype, device=ids.device)
    if flat.numel():
        _gather_rows_kernel[(flat.numel(),)](
            table,
            flat,
            scales if scales is not None else flat,
            out,
            dim,
            shard_rows,
            HAS_SCALE=scales is not None,
            BLOCK=triton.next_power_of_2(dim),
        )
    return out.view(*ids.shape, dim)
