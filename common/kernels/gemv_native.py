"""One row of x times a mid-sized bf16 weight as a CUDA C kernel (common/kernels/cuda/gemv_row.cu): a warp a
row (two below 4,096 inputs), each lane's share of its rows' weights all loaded before the programmatic wait,
x staged in shared memory after it, the warp's sum through shuffles. For the decode step's projections of
a few thousand rows, where the Triton GEMV (gemv.py) splits K and folds the chunks: the token mixers' output
projections and the MoE input projection. `fused_linear.linear` calls it where `takes` holds; weights of
CUBLAS_ROWS rows and more keep the Triton GEMV's one-chunk launch.
"""

from __future__ import annotations

import ctypes

import torch

from common.kernels import native
from common.kernels.config import KERNELS, KernelConfig
from common.kernels.gemv import CUBLAS_ROWS
from common.kernels.pdl import hopper_or_later, launch, native_mode

MAX_CHUNKS = 32
"""16-byte chunks a lane a row at most (gemv_row.cu's kMaxChunks): K up to 8,192."""
TWO_ROWS = 16
"""Chunks a lane up to which a warp takes two rows (gemv_row.cu's kTwoRowChunks): K up to 4,096."""
WARPS = 4
"""Warps a block."""
_P, _I = ctypes.c_void_p, ctypes.c_int
_SIGNATURE = (_P,) * 4 + (_I,) * 6 + (_P,)


def _entry(device: torch.device):
    return native.entry(device, "gemv_row", "spillway_gemv_row", _SIGNATURE)


def takes(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, kernels: KernelConfig = KERNELS
) -> bool:
    """Whether x [1, K] · weight [N, K]ᵀ (+ bias) runs here: one bf16 row on a CUDA device of compute
    capability 9 on, a contiguous bf16 weight of fewer than CUBLAS_ROWS rows (and a contiguous bf16 bias),
    K a multiple of 256 up to 256 · MAX_CHUNKS, the library built, and KernelConfig.gemv_native."""
    n, k = weight.shape
    return (
        kernels.gemv_native
        and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()))
        and x.is_cuda
        and x.shape[0] == 1
        and x.dtype == weight.dtype == torch.bfloat16
        and weight.is_contiguous()
        and n < CUBLAS_ROWS
        and k % 256 == 0
        and k // 256 <= MAX_CHUNKS
        and hopper_or_later(x.device.index)
        and _entry(x.device) is not None
    )


def gemv_row(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, kernels: KernelConfig = KERNELS
) -> torch.Tensor:
    """x [1, K] · weightᵀ (+ bias [N]) → [1, N] bf16, launched in programmatic dependent launch as the
    Triton GEMV is (KernelConfig.gemv_pdl). `takes` must hold."""
    n, k = weight.shape
    x = x.contiguous()
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    pdl = launch(x.device, kernels.gemv_pdl, kernels=kernels)
    rows = 2 if k // 256 <= TWO_ROWS else 1
    status = _entry(x.device)(
        weight.data_ptr(), x.data_ptr(), bias.data_ptr() if bias is not None else None, y.data_ptr(), n, k,
        rows, WARPS, "launch_pdl" in pdl, native_mode(pdl), torch.cuda.current_stream(x.device).cuda_stream,
    )  # fmt: skip
    native.check(status, "spillway_gemv_row")
    return y
