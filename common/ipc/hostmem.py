"""Host memory the GPU reads directly: page-locked and mapped into the device's address space.

Large host stores (the n-gram table; later the routed experts) are registered in place with
cudaHostRegister, never copied through `pin_memory()`, which rounds each allocation up to a power of two.
"""

from __future__ import annotations

import torch

_CUDA_HOST_REGISTER_MAPPED = 2  # cudaHostRegisterMapped: the device may address it (UVA)


def register_mapped(tensor: torch.Tensor) -> bool:
    """Page-lock a contiguous CPU tensor's memory and map it for the GPU. False where there is no CUDA."""
    if not torch.cuda.is_available():
        return False
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("only a contiguous CPU tensor can be registered")
    size = tensor.numel() * tensor.element_size()
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), size, _CUDA_HOST_REGISTER_MAPPED)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {size} bytes failed with CUDA error {int(err)}")
    return True


def unregister(tensor: torch.Tensor) -> None:
    """Undo register_mapped (before the memory is freed)."""
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


def host_list_to(values: list, device: torch.device | str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """`values` as a tensor on `device`; to a GPU through pinned memory and an asynchronous copy. torch
    copies pageable memory synchronously: the host waits for the stream to drain, then the GPU idles while
    the host builds the rest of the pass (bench/LOG.md, Prefill host syncs and gaps). Small lists
    (a pass's ids, lengths, page table): torch's caching host allocator recycles their pinned blocks,
    recording each copy's event, and its power-of-two rounding (why the stores are registered with
    `register_mapped` instead) costs nothing at this size. Not in graph capture, where the copy would be
    recorded from a pinned block that the replay finds reused (the pageable copy raised there)."""
    return host_tensor_to(torch.tensor(values, dtype=dtype), device)


def host_tensor_to(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A small host tensor on `device`, as `host_list_to` moves a list: through a recycled pinned block
    and an asynchronous copy to a GPU."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    assert not torch.cuda.is_current_stream_capturing(), "a host tensor copied in graph capture"
    return host.pin_memory().to(device, non_blocking=True)
