"""The n-gram embedding table, kept in host memory; a step gathers only the rows its tokens hash to.

The table is 320M rows × 160 for Flash-Next (51.2B parameters): it never goes to the GPU. It is stored in the
checkpoint's dtype: bf16, or fp8 e4m3 with one scale per checkpoint shard (rows of shard j are scaled by
scales[j] when gathered).
"""

from __future__ import annotations

import torch


class NGramTable:
    """Rows [R, d] in host memory, gathered by id into the compute device and dtype."""

    def __init__(self, rows: torch.Tensor, shard_scales: torch.Tensor | None = None) -> None:
        self.rows = rows
        self.shard_scales = shard_scales
        self.shard_rows = rows.shape[0] // (1 if shard_scales is None else shard_scales.numel())

    @property
    def dim(self) -> int:
        return self.rows.shape[1]

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """ids [...] int64 (any device) → rows [..., d] in `dtype` on ids' device."""
        host_ids = ids.to(self.rows.device)
        rows = self.rows[host_ids]
        if self.shard_scales is not None:
            rows = rows.float() * self.shard_scales[host_ids // self.shard_rows][..., None]
        return rows.to(device=ids.device, dtype=dtype, non_blocking=True)
