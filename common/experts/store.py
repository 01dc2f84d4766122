"""The host expert store: every routed expert of every MoE layer in one host allocation.

Layout: for each MoE layer, for each component of the expert format, a block [E, *component shape] — so
each expert of a layer sits at a fixed stride inside its block and a copy or a kernel can address it by
(layer, component, expert). The allocation is an anonymous mmap of exactly the bytes needed; on a CUDA
machine it is registered (page-locked and mapped) in place, so the GPU reads it directly.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from common.ipc.hostmem import register_mapped, unregister

_ALIGN = 256  # block starts aligned for vectorised loads


class HostExpertStore:
    """parts[layer][component] is a [E, *shape] view of one host allocation."""

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        components: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        map_for_gpu: bool = True,
        backing: Path | None = None,
        writable_file: bool = False,
        allocate: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        """An anonymous allocation, or with `backing` the file's bytes mapped in place (a converted artifact:
        `writable_file` to write it, else private copy-on-write pages, so the file is never modified), or
        `allocate(nbytes)`'s uint8 CPU tensor (shared memory another process maps)."""
        self.num_layers, self.num_experts = num_layers, num_experts
        self.components = dict(components)
        offsets, size = [], 0
        for _ in range(num_layers):
            layer = {}
            for name, (shape, dtype) in self.components.items():
                layer[name] = size
                size += _aligned(num_experts * math.prod(shape) * dtype.itemsize)
            offsets.append(layer)
        self.nbytes = size
        if allocate is not None:
            buffer = allocate(size)
            if buffer.dtype != torch.uint8 or buffer.numel() != size or buffer.device.type != "cpu":
                raise ValueError(f"expert store buffer: expected {size} uint8 bytes on the host")
            self._mmap, self.buffer = None, buffer
        else:
            self._mmap = _map(size, backing, writable_file)
            self._anonymous = backing is None
            self.buffer = (
                torch.frombuffer(self._mmap, dtype=torch.uint8, count=size) if size else torch.empty(0)
            )
        self.parts: list[dict[str, torch.Tensor]] = [
            {name: self._view(off[name], shape, dtype) for name, (shape, dtype) in self.components.items()}
            for off in offsets
        ]
        self.mapped = map_for_gpu and size > 0 and register_mapped(self.buffer)

    def _view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        count = self.num_experts * math.prod(shape) * dtype.itemsize
        return self.buffer[offset : offset + count].view(dtype).view(self.num_experts, *shape)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert in the runtime format (its cache-slot size)."""
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in self.components.values())

    def expert(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """One expert's components (views into the store)."""
        return {name: block[expert] for name, block in self.parts[layer].items()}

    def fill(self, layer: int, packed: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """Write a layer's experts (packed components, in expert order)."""
        for name, block in self.parts[layer].items():
            block.copy_(torch.stack([p[name] for p in packed]))

    def release(self) -> None:
        """Give the memory of a store this process mapped back to the OS (all-experts-fit mode: every expert
        lives in VRAM). The layout stays; what is read afterwards is zeros (anonymous memory) or the file's
        bytes again. A store in memory another process maps (`allocate`) keeps its memory."""
        if self._mmap is None:
            return
        if self.mapped:  # pinned pages cannot be discarded
            unregister(self.buffer)
            self.mapped = False
        # an anonymous mapping is shared memory: MADV_REMOVE frees it; a file's private pages just drop
        self._mmap.madvise(mmap.MADV_REMOVE if self._anonymous else mmap.MADV_DONTNEED)

    def __del__(self) -> None:
        if getattr(self, "mapped", False):
            unregister(self.buffer)


def _map(size: int, backing: Path | None, writable_file: bool) -> mmap.mmap:
    if backing is None:
        return mmap.mmap(-1, max(size, 1))
    if writable_file:
        backing.touch()
    mode = "r+b" if writable_file else "rb"
    with open(backing, mode) as f:
        if writable_file:
            f.truncate(size)
        elif backing.stat().st_size != size:
            raise ValueError(f"{backing}: {backing.stat().st_size} bytes, the layout needs {size}")
        return mmap.mmap(f.fileno(), size, access=mmap.ACCESS_WRITE if writable_file else mmap.ACCESS_COPY)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN
