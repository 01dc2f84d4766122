"""Tables kept in host memory, of which a step gathers only the rows its tokens need.

PLE's n-gram table (320M rows × 160 for Flash-Next, 51.2B parameters) never goes to the GPU; it is stored in
the checkpoint's dtype: bf16, or fp8 e4m3 with one scale per checkpoint shard (rows of shard j are scaled by
scales[j] when gathered). With `--embeddings-on-host` the token embedding is one too (HostEmbedding).
"""

from __future__ import annotations

import torch

from common.ipc.hostmem import register_mapped, unregister


class HostRows:
    """Rows [R, d] in host memory, gathered by id into the compute device and dtype.

    On a CUDA machine the rows are registered (page-locked, mapped) and a kernel gathers them on the GPU
    with no host round trip; elsewhere the gather runs on the host.
    """

    def __init__(
        self, rows: torch.Tensor, shard_scales: torch.Tensor | None = None, shard_rows: int = 1
    ) -> None:
        self.rows = rows.contiguous()
        self.shard_scales = shard_scales
        self.shard_rows = shard_rows
        """Rows per checkpoint shard (the last may have fewer): row r is scaled by shard r // shard_rows."""
        self.mapped = register_mapped(self.rows)
        self._device_scales: dict[torch.device, torch.Tensor] = {}

    def __del__(self) -> None:
        # Unregister before the memory goes back to the allocator: a later allocation at the same address
        # could not be registered again (cudaErrorHostMemoryAlreadyRegistered).
        if getattr(self, "mapped", False):
            unregister(self.rows)

    @property
    def dim(self) -> int:
        return self.rows.shape[1]

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """ids [...] int64 (any device) → rows [..., d] in `dtype` on ids' device."""
        if ids.is_cuda and self.mapped:
            from common.kernels.gather import gather_rows

            return gather_rows(self.rows, ids, dtype, self._scales_on(ids.device), self.shard_rows)
        host_ids = ids.to(self.rows.device)
        rows = self.rows[host_ids]
        if self.shard_scales is not None:
            rows = rows.float() * self.shard_scales[host_ids // self.shard_rows][..., None]
        return rows.to(device=ids.device, dtype=dtype, non_blocking=True)

    def _scales_on(self, device: torch.device) -> torch.Tensor | None:
        if self.shard_scales is None:
            return None
        if device not in self._device_scales:
            self._device_scales[device] = self.shard_scales.to(device, torch.float32)
        return self._device_scales[device]
