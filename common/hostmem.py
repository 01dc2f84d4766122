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
