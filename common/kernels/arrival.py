"""Sums folded into the kernel that writes their terms: the last program to arrive adds them up.

Each program of a decode kernel writing one term of a sum (a GEMV's chunk of K, an expert's share of a MoE
output) counts its arrival at its output tile's counter (`arrive`); the last to arrive reads the terms in
their fixed order, writes the sum (bit for bit the separate kernel's) and zeroes the counter. Why: at one row
a kernel of its own for the sum is a launch and ramp for a few KB.

Memory order (a serial split-K reduction's): terms written, a CTA barrier, one GPU-scope acq_rel atomic add;
Triton broadcasts its result behind a barrier, so the last program reads the terms after its acquire, past
L1 (`.cg`).

Counters: one zeroed buffer per device and stream (`counters`), touched only after `gdc_enter` (the kernel
before complete: every counter at zero). KernelConfig.fold_sums False: separate kernels. QSA's selection
also counts arrivals here (not a sum: `fold_sums` leaves it be).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.kernels.config import KERNELS, KernelConfig

ROWS = 1
"""Rows (tokens) up to which the sums fold. Past one row the kernels run longer, and one launch saved is worth
less than every program's atomic at its tail."""
COUNTERS = 8192
"""Counters a buffer: output tiles of one launch (a GEMV's row tiles, tokens × down's row blocks)."""

_buffers: dict[tuple[torch.device, int | None], torch.Tensor] = {}


def counters(device: torch.device, needed: int) -> torch.Tensor:
    """The current stream's counters on `device` ([COUNTERS] int32, zero: every kernel leaves them so). Made
    at a stream's first use: in a recorded pass, zeroed by a memset node at that point of every replay."""
    assert needed <= COUNTERS, f"{needed} output tiles: at most {COUNTERS} counters"
    stream = None
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        stream = torch.cuda.current_stream(device).cuda_stream
    key = (device, stream)
    if key not in _buffers:
        _buffers[key] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return _buffers[key]


def folds(rows: int, kernels: KernelConfig = KERNELS) -> bool:
    """Whether a sum over `rows` rows folds into the kernel that writes its terms."""
    return kernels.fold_sums and rows <= ROWS


@triton.jit
def arrive(counter_ptr, terms):
    """Count this program's arrival (after its writes) → True in the last of `terms` programs to arrive,
    which then sees every one's writes (read them with `.cg`) and leaves the counter at zero."""
    tl.debug_barrier()  # every thread's writes before the count
    last = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == terms - 1
    if last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def sum_terms(ptr, i, live, stride, terms):
    """Σ over `terms` terms `stride` apart, in order (the same sum every run), at indices i of the first:
    what the last program to arrive reads, past L1."""
    acc = tl.zeros(i.shape, dtype=tl.float32)
    for s in range(terms):
        acc += tl.load(ptr + s * stride + i, mask=live, other=0.0, cache_modifier=".cg")
    return acc
