"""The int4 decode MoE's gate/up as the CUDA C kernel common/kernels/cuda/int4_gate_up.cu (one warp a few
rows, its inputs in registers, three instructions a code), where moe_int4's Triton gate_up needs ~7
(`bench.sass_census`). `moe_int4_decode` calls `gate_up` when its DecodeConfig asks (`native_rows`) and the
kernel can take the call; down and the sum stay Triton's.
"""

from __future__ import annotations

import ctypes

import torch

from common.kernels import native
from common.kernels.pdl import WAIT_ONLY

MAX_HIDDEN = 3072
"""The kernel keeps three 16-byte chunks a lane a row: inputs up to 3 × 32 × 32."""
_ARGS = (ctypes.c_void_p,) * 3 + (ctypes.c_int,) * 3 + (ctypes.c_void_p,) * 4 + (ctypes.c_int,) * 11
_ARGS += (ctypes.c_void_p,)


def _function(device: torch.device):
    lib = native.library("int4_gate_up", native.arch_of(device.index or 0))
    if lib is None:
        return None
    fn = lib.spillway_int4_gate_up
    fn.argtypes, fn.restype = _ARGS, ctypes.c_int
    return fn


def available(x: torch.Tensor, hidden: int, inter: int, rows_per_warp: int, warps: int) -> bool:
    """Whether the kernel takes this call: bf16 x on a CUDA device of compute capability 9 on (its
    programmatic launch), hidden a multiple of 128 up to MAX_HIDDEN, inter whole blocks of rows, and the
    library built."""
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device.index)[0] >= 9
        and hidden % 128 == 0
        and hidden <= MAX_HIDDEN
        and rows_per_warp in (1, 2, 4)
        and inter % (rows_per_warp * warps) == 0
        and _function(x.device) is not None
    )


def gate_up(
    x: torch.Tensor, rows: torch.Tensor, row_of: torch.Tensor | None, pool: dict[str, torch.Tensor],
    act: torch.Tensor, k: int, rows_per_warp: int, warps: int, layout: int, pdl: dict, settled: bool,
) -> None:  # fmt: skip
    """act [P, I] fp32 ← silu(gate) · up of each pair p's expert (pool row row_of[rows[p]], or rows[p]) at
    x[p // k], stored in down's layout: `layout` 0 in order, 1 words (DecodeConfig.words), 2 split
    (DecodeConfig.split_act). `pdl`: the call's
    `pdl.launch(...)` keywords; `settled`: the rows are not the kernel just before's outputs, so their codes
    are loaded before the programmatic wait. `available` must hold."""
    hidden, inter = x.shape[1], act.shape[1]
    gdc = {True: 1, WAIT_ONLY: 2}.get(pdl["GDC"], 0)
    status = _function(x.device)(
        x.data_ptr(), rows.data_ptr(), (row_of if row_of is not None else rows).data_ptr(),
        rows.dtype == torch.int64, (row_of if row_of is not None else rows).dtype == torch.int64,
        row_of is not None, pool["gate_up_qweight"].data_ptr(), pool["gate_up_scales"].data_ptr(),
        pool["gate_up_zeros"].data_ptr(), act.data_ptr(), rows.numel(), k, hidden, inter, rows_per_warp,
        warps, -(-hidden // 1024), layout, "launch_pdl" in pdl, gdc, settled,
        torch.cuda.current_stream(x.device).cuda_stream,
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"int4 gate_up CUDA kernel: launch failed with cudaError {status}")
