"""The int4 decode MoE's gate/up and down as CUDA C kernels (common/kernels/cuda/int4_decode.cu: a warp a few
rows, the inputs each lane's codes multiply in registers, every code loaded before any math and, where the
rows are settled, before the programmatic wait). `moe_int4_decode` calls them when its DecodeConfig asks
(`native_rows`, `native_down_warps`) and they can take the call; else Triton's.

What they gain is the loads in flight, not instructions: the scalar gate/up issues about as many instructions
a weight as Triton's words form (`bench.sass_census --native`).
"""

from __future__ import annotations

import ctypes

import torch

from common.kernels import native
from common.kernels.pdl import hopper_or_later, native_mode

MAX_HIDDEN = 3072
"""gate/up keeps three 16-byte chunks a lane a row: inputs up to 3 × 32 × 32."""
MAX_INTER = 1024
"""down reads one chunk a group a lane, eight groups at most."""
MMA_MAX_HIDDEN = 2560
"""The tensor-core gate/up holds five groups of codes a warp, four warps a block: inputs up to 2,560."""
_P, _I = ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    "spillway_int4_gate_up": (_P,) * 3 + (_I,) * 3 + (_P,) * 4 + (_I,) * 11 + (_P,),
    "spillway_int4_down": (_P,) * 3 + (_I,) * 3 + (_P, _I) + (_P,) * 7 + (_I, _P) + (_I,) * 8 + (_P,),
    "spillway_int4_gate_up_mma": (_P,) * 3 + (_I,) * 3 + (_P,) * 4 + (_I,) * 8 + (_P,),
    "spillway_int4_down_mma": (_P,) * 3 + (_I,) * 3 + (_P, _I) + (_P,) * 7 + (_I, _P) + (_I,) * 7 + (_P,),
}
MMA_DOWN_ROWS = 64
"""The tensor-core down's rows a block (16 a warp, 4 warps): hidden a multiple of it."""


def _function(device: torch.device, name: str):
    """The library's entry point `name` for `device`, typed; None where the library cannot be built."""
    return native.entry(device, "int4_decode", name, _SIGNATURES[name])


def _hopper_bf16(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype == torch.bfloat16 and hopper_or_later(x.device.index)


def available(x: torch.Tensor, hidden: int, inter: int, rows_per_warp: int, warps: int) -> bool:
    """Whether gate/up takes this call: bf16 x on a CUDA device of compute capability 9 on (its programmatic
    launch), hidden a multiple of 128 up to MAX_HIDDEN, inter whole blocks of rows, and the library built."""
    return (
        _hopper_bf16(x)
        and hidden % 128 == 0
        and hidden <= MAX_HIDDEN
        and rows_per_warp in (1, 2, 4)
        and inter % (rows_per_warp * warps) == 0
        and _function(x.device, "spillway_int4_gate_up") is not None
    )


def mma_available(x: torch.Tensor, hidden: int, inter: int) -> bool:
    """Whether the tensor-core gate/up takes this call: as `available`'s device and dtype, hidden a multiple
    of 128 up to MMA_MAX_HIDDEN, inter a multiple of 16 (a block's rows)."""
    return (
        _hopper_bf16(x)
        and hidden % 128 == 0
        and hidden <= MMA_MAX_HIDDEN
        and inter % 16 == 0
        and _function(x.device, "spillway_int4_gate_up_mma") is not None
    )


def down_available(x: torch.Tensor, inter: int, warps: int, shared_gate: torch.Tensor | None) -> bool:
    """Whether down takes this call: as `available`'s device and dtype (the shared expert's gate's too),
    inter a multiple of 128 up to MAX_INTER, hidden whole blocks of 8 × warps rows."""
    return (
        _hopper_bf16(x)
        and (shared_gate is None or shared_gate.dtype == torch.bfloat16)
        and inter % 128 == 0
        and inter <= MAX_INTER
        and x.shape[1] % (8 * warps) == 0
        and _function(x.device, "spillway_int4_down") is not None
    )


def down_mma_available(x: torch.Tensor, inter: int, shared_gate: torch.Tensor | None) -> bool:
    """Whether the tensor-core down takes this call: as `down_available`'s device, dtypes and inter, hidden
    whole blocks of MMA_DOWN_ROWS rows."""
    return (
        _hopper_bf16(x)
        and (shared_gate is None or shared_gate.dtype == torch.bfloat16)
        and inter % 128 == 0
        and inter <= MAX_INTER
        and x.shape[1] % MMA_DOWN_ROWS == 0
        and _function(x.device, "spillway_int4_down_mma") is not None
    )


def _rows(rows: torch.Tensor, row_of: torch.Tensor | None) -> tuple:
    """The kernels' pair-row arguments: rows, the lookup table (rows again without one), whether each holds
    int64, and whether to look up."""
    lookup = row_of if row_of is not None else rows
    wide = (rows.dtype == torch.int64, lookup.dtype == torch.int64)
    return rows.data_ptr(), lookup.data_ptr(), *wide, row_of is not None


def _matrix(pool: dict[str, torch.Tensor], name: str) -> tuple:
    """A pool matrix's codes, scales and zeros, as pointers."""
    return tuple(pool[f"{name}_{part}"].data_ptr() for part in ("qweight", "scales", "zeros"))


def gate_up(
    x: torch.Tensor, rows: torch.Tensor, row_of: torch.Tensor | None, pool: dict[str, torch.Tensor],
    act: torch.Tensor, k: int, rows_per_warp: int, warps: int, layout: int, pdl: dict, settled: bool,
    mma: bool = False,
) -> None:  # fmt: skip
    """act [P, I] fp32 ← silu(gate) · up of each pair p's expert (pool row row_of[rows[p]], or rows[p]) at
    x[p // k], stored in down's layout: `layout` 0 in order, 1 words (DecodeConfig.words), 2 split
    (DecodeConfig.split_act). `pdl`: the call's `pdl.launch(...)` keywords; `settled`: the rows are not the
    kernel just before's outputs, so their codes are loaded before the programmatic wait. `available` must
    hold. `mma`: on the tensor cores instead (int4_decode.cu's gate_up_mma_kernel: 16 rows a block of 4
    warps, each warp a quarter of the groups, one group's codes loaded ahead of the one it multiplies;
    `rows_per_warp` and `warps` unused); `mma_available` must hold."""
    hidden, inter = x.shape[1], act.shape[1]
    shape = () if mma else (rows_per_warp, warps, -(-hidden // 1024))
    name = "spillway_int4_gate_up_mma" if mma else "spillway_int4_gate_up"
    status = _function(x.device, name)(
        x.data_ptr(), *_rows(rows, row_of), *_matrix(pool, "gate_up"), act.data_ptr(), rows.numel(), k,
        hidden, inter, *shape, layout, "launch_pdl" in pdl, native_mode(pdl), settled,
        torch.cuda.current_stream(x.device).cuda_stream,
    )  # fmt: skip
    native.check(status, name)


def down(
    act: torch.Tensor, rows: torch.Tensor, row_of: torch.Tensor | None, weights: torch.Tensor,
    pool: dict[str, torch.Tensor], partial: torch.Tensor, out: torch.Tensor, k: int, warps: int,
    fold: torch.Tensor | None, shared: torch.Tensor | None, shared_gate: torch.Tensor | None, pdl: dict,
    mma: bool = False,
) -> None:  # fmt: skip
    """partial [P, H] fp32 ← weights[p] · down of each pair's expert at act[p] (words layout); with `fold`
    (the stream's arrival counters), out [T, H] ← each token's k partial rows summed in order, plus `shared`
    (gated by σ(shared_gate[t, 0]) when given), by the last pair of a block of rows to finish. Without, the
    caller sums them. `down_available` must hold. `mma`: on the tensor cores instead (int4_decode.cu's
    down_mma_kernel: 16 rows a warp, 4 warps a block, `warps` unused), act bf16 in order (gate/up's
    layout 3); `down_mma_available` must hold."""
    hidden, inter = partial.shape[1], act.shape[1]
    gate_stride = shared_gate.stride(0) if shared_gate is not None else 0
    name = "spillway_int4_down_mma" if mma else "spillway_int4_down"
    status = _function(act.device, name)(
        act.data_ptr(), *_rows(rows, row_of), weights.data_ptr(), weights.dtype == torch.bfloat16,
        *_matrix(pool, "down"), partial.data_ptr(), fold.data_ptr() if fold is not None else None,
        shared.data_ptr() if shared is not None else None,
        shared_gate.data_ptr() if shared_gate is not None else None, gate_stride, out.data_ptr(),
        rows.numel(), k, hidden, inter, *(() if mma else (warps,)), fold is not None, "launch_pdl" in pdl,
        native_mode(pdl), torch.cuda.current_stream(act.device).cuda_stream,
    )  # fmt: skip
    native.check(status, name)
