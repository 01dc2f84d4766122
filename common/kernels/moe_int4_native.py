"""The int4 decode MoE's gate/up and down as CUDA C kernels (common/kernels/cuda/int4_decode.cu: a warp a few
rows, the inputs each lane's codes multiply in registers, every code loaded before any math and, where the
rows are settled, before the programmatic wait). `moe_int4_decode` calls them when its DecodeConfig asks
(`native_rows`, `native_down_warps`) and they can take the call; else Triton's.

What they gain is the loads in flight, not instructions: compiled for sm_90 (`bench.sass_census --native`),
gate/up issues 2,264 instructions a warp for 4 rows × 2,560 inputs, ~6.8 a weight a lane (three in the inner
dot, the rest converting inputs, scales and zeros, addresses), where Triton's words form issues ~7.4.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

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
    "spillway_int4_gate_up_mma": (_P,) * 3 + (_I,) * 3 + (_P,) * 4 + (_I,) * 8 + (_P,) * 2,
    "spillway_int4_down_mma": (_P,) * 3 + (_I,) * 3 + (_P, _I) + (_P,) * 7 + (_I, _P) + (_I,) * 7 + (_P,) * 2,
}
ROUTE_MAX_EXPERTS = 512
"""The experts a router may choose among where the kernels route (int4_decode.cu's kRouteMaxExperts: a lane
holds 16 of a token's logits)."""


class _Route(ctypes.Structure):
    """int4_decode.cu's `Route`, field for field."""

    _fields_ = [
        ("logits", _P), ("logits_stride", _I), ("experts", _I), ("normalize", _I),
        ("bf16_weights", _I), ("trace_ids", _P), ("trace_wide", _I), ("trace_weights", _P), ("cursor", _P),
        ("trace_rows", _I), ("trace_layers", _I), ("layer", _I), ("tokens", _I), ("router_ids", _P),
        ("finished", _P),
    ]  # fmt: skip


@dataclass(frozen=True)
class Route:
    """The router's choice made by the expert kernels themselves (int4_decode.cu's `Route`): every block of
    gate/up and of down picks its pair's expert from the router's logits, so that no kernel runs between the
    router's GEMV and gate/up. With `replay`, the trace's rows are what the experts use (the router's choice
    is still made, as in serving) and down's last block moves the cursor on."""

    logits: torch.Tensor
    """[T, E] router logits, bf16, unit column stride; E at most ROUTE_MAX_EXPERTS."""
    top_k: int
    normalize: bool
    """The top k's weights renormalised to sum to one."""
    bf16_weights: bool
    """The weights rounded to bf16 (as the router's kernel writes them for a bf16 model)."""
    replay: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None
    """A routing replay's rows on the device: (ids [rows, layers, k] int32/int64, weights [rows, layers, k]
    fp32, cursors [layers] int64, the trace layer), as RoutingReplayer.device_rows gives them."""
    router_ids: torch.Tensor
    """[T · k] int64, written: the router's choice (gate/up's first block of rows writes it)."""
    finished: torch.Tensor
    """An int32 counter, zero (down's last block leaves it zero)."""

    def as_struct(self) -> _Route:
        logits, replay = self.logits, self.replay
        assert (
            logits.dtype == torch.bfloat16 and logits.stride(1) == 1 and logits.shape[1] <= ROUTE_MAX_EXPERTS
        )
        trace_ids, trace_weights, cursors, layer = replay if replay is not None else (None, None, None, 0)
        return _Route(
            logits.data_ptr(), logits.stride(0), logits.shape[1],
            self.normalize, self.bf16_weights, trace_ids.data_ptr() if replay else None,
            trace_ids.dtype == torch.int64 if replay else 0, trace_weights.data_ptr() if replay else None,
            cursors[layer].data_ptr() if replay else None, *(trace_ids.shape[:2] if replay else (0, 0)),
            layer, logits.shape[0], self.router_ids.data_ptr(), self.finished.data_ptr(),
        )  # fmt: skip


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


def _address(struct: ctypes.Structure | None) -> int | None:
    """A struct argument's address (the caller holds the struct until the call returns), or null."""
    return None if struct is None else ctypes.addressof(struct)


def _matrix(pool: dict[str, torch.Tensor], name: str) -> tuple:
    """A pool matrix's codes, scales and zeros, as pointers."""
    return tuple(pool[f"{name}_{part}"].data_ptr() for part in ("qweight", "scales", "zeros"))


def gate_up(
    x: torch.Tensor, rows: torch.Tensor, row_of: torch.Tensor | None, pool: dict[str, torch.Tensor],
    act: torch.Tensor, k: int, rows_per_warp: int, warps: int, layout: int, pdl: dict, settled: bool,
    mma: bool = False, route: Route | None = None,
) -> None:  # fmt: skip
    """act [P, I] fp32 ← silu(gate) · up of each pair p's expert (pool row row_of[rows[p]], or rows[p]) at
    x[p // k], stored in down's layout: `layout` 0 in order, 1 words (DecodeConfig.words), 2 split
    (DecodeConfig.split_act). `pdl`: the call's `pdl.launch(...)` keywords; `settled`: the rows are not the
    kernel just before's outputs, so their codes are loaded before the programmatic wait. `available` must
    hold. `mma`: on the tensor cores instead (int4_decode.cu's gate_up_mma_kernel: 16 rows a block of 4
    warps, each warp a quarter of the groups, one group's codes loaded ahead of the one it multiplies;
    `rows_per_warp` and `warps` unused); `mma_available` must hold. `route` (tensor cores only): each
    block picks its pair's expert (`Route`; rows, [P], is then where the router's choice is written)."""
    assert route is None or mma, "routing in the kernel: the tensor-core gate/up"
    struct = route.as_struct() if route is not None else None  # held until the launch has copied it
    hidden, inter = x.shape[1], act.shape[1]
    shape = () if mma else (rows_per_warp, warps, -(-hidden // 1024))
    name = "spillway_int4_gate_up_mma" if mma else "spillway_int4_gate_up"
    status = _function(x.device, name)(
        x.data_ptr(), *_rows(rows, row_of), *_matrix(pool, "gate_up"), act.data_ptr(), rows.numel(), k,
        hidden, inter, *shape, layout, "launch_pdl" in pdl, native_mode(pdl), settled,
        *((_address(struct),) if mma else ()), torch.cuda.current_stream(x.device).cuda_stream,
    )  # fmt: skip
    native.check(status, name)


def down(
    act: torch.Tensor, rows: torch.Tensor, row_of: torch.Tensor | None, weights: torch.Tensor,
    pool: dict[str, torch.Tensor], partial: torch.Tensor, out: torch.Tensor, k: int, warps: int,
    fold: torch.Tensor | None, shared: torch.Tensor | None, shared_gate: torch.Tensor | None, pdl: dict,
    mma: bool = False, route: Route | None = None,
) -> None:  # fmt: skip
    """partial [P, H] fp32 ← weights[p] · down of each pair's expert at act[p] (words layout); with `fold`
    (the stream's arrival counters), out [T, H] ← each token's k partial rows summed in order, plus `shared`
    (gated by σ(shared_gate[t, 0]) when given), by the last pair of a block of rows to finish. Without, the
    caller sums them. `down_available` must hold. `mma`: on the tensor cores instead (int4_decode.cu's
    down_mma_kernel: 16 rows a warp, 4 warps a block, `warps` unused), act bf16 in order (gate/up's
    layout 3); `down_mma_available` must hold. `route` (tensor cores only): as gate/up's, each block
    computing its pair's weight too (rows and weights unread)."""
    assert route is None or mma, "routing in the kernel: the tensor-core down"
    struct = route.as_struct() if route is not None else None  # held until the launch has copied it
    hidden, inter = partial.shape[1], act.shape[1]
    gate_stride = shared_gate.stride(0) if shared_gate is not None else 0
    name = "spillway_int4_down_mma" if mma else "spillway_int4_down"
    status = _function(act.device, name)(
        act.data_ptr(), *_rows(rows, row_of), weights.data_ptr(), weights.dtype == torch.bfloat16,
        *_matrix(pool, "down"), partial.data_ptr(), fold.data_ptr() if fold is not None else None,
        shared.data_ptr() if shared is not None else None,
        shared_gate.data_ptr() if shared_gate is not None else None, gate_stride, out.data_ptr(),
        rows.numel(), k, hidden, inter, *(() if mma else (warps,)), fold is not None, "launch_pdl" in pdl,
        native_mode(pdl), *((_address(struct),) if mma else ()),
        torch.cuda.current_stream(act.device).cuda_stream,
    )  # fmt: skip
    native.check(status, name)
