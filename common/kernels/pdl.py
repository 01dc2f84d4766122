"""Programmatic dependent launch for the decode kernels (Hopper on): a kernel launched with it may start while
the kernel before it finishes, then waits in `gdc_enter` (griddepcontrol.wait: earlier grids done, their
writes visible) before it reads what the kernel just before wrote. Weights and older kernels' outputs may be
loaded before the wait: the kernel just before lets this one launch only after its own wait or, if it does
not take part (torch's, cuBLAS's), once its programs have exited. The kernel just before must be known:
a torch copy inserted before a launch (`.contiguous()`) becomes it.

Why: a decode step is many small kernels; the next kernel's ramp and first weight loads overlap the previous
one's tail. CUDA graphs keep the edges a stream capture records (CUDA 12.3 on). KernelConfig.pdl
switches it. A kernel taking part calls `gdc_enter(GDC)` in every program before its first read of an
earlier kernel's output and its first write, and is launched with `**launch(device)`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from common.kernels.config import KERNELS, KernelConfig

WAIT_ONLY = 2
"""`GDC`'s value without KernelConfig.pdl_early_trigger: wait, no trigger (True: wait, then trigger)."""
TRIGGER_FIRST = 3
"""`GDC`'s value of a `trigger_first` launch with KernelConfig.pdl_start_trigger: trigger, then wait."""
WAIT_ONLY_K = tl.constexpr(WAIT_ONLY)
TRIGGER_FIRST_K = tl.constexpr(TRIGGER_FIRST)


def launch(
    device: torch.device,
    take_part: bool = True,
    hold_next: bool = False,
    trigger_first: bool = False,
    kernels: KernelConfig = KERNELS,
) -> dict[str, object]:
    """Keyword arguments of a participating kernel's launch: its `GDC` constexpr, and Triton's `launch_pdl`
    when on (never in the interpreter: griddepcontrol is PTX). `take_part` False: this launch stays out.
    `hold_next`: this launch lets the next kernel launch only at its programs' exit (as without
    `kernels.pdl_early_trigger`, for this launch alone): the next one is a kernel that early residency
    slows. `trigger_first`: with `kernels.pdl_start_trigger`, the next kernel may launch as this one's
    programs start (that kernel must read only weights before its wait). `kernels.pdl` False: no launch
    takes part."""
    on = take_part and kernels.pdl and device.type == "cuda" and hopper_or_later(device.index)
    if not on:
        return {"GDC": False}
    if not kernels.pdl_early_trigger or hold_next:
        return {"GDC": WAIT_ONLY, "launch_pdl": True}
    first = trigger_first and kernels.pdl_start_trigger
    return {"GDC": TRIGGER_FIRST if first else True, "launch_pdl": True}


def native_mode(kwargs: dict[str, object]) -> int:
    """A CUDA C kernel's `gdc` argument (common/kernels/cuda/launch.cuh) for `launch`'s keywords: 0 no wait,
    1 wait then trigger, 2 wait only (no CUDA C kernel is launched `trigger_first`)."""
    assert kwargs["GDC"] != TRIGGER_FIRST, "trigger_first: Triton kernels only"
    modes: dict[object, int] = {True: 1, WAIT_ONLY: 2}
    return modes.get(kwargs["GDC"], 0)


@functools.cache
def hopper_or_later(index: int | None) -> bool:
    """Compute capability 9 or more (asked of the driver once a device, not at every launch)."""
    return torch.cuda.get_device_capability(index)[0] >= 9


@triton.jit
def gdc_enter(GDC: tl.constexpr):
    """With GDC: wait for the earlier kernels (their writes visible), then (GDC True, not WAIT_ONLY) let the
    next kernel launch; TRIGGER_FIRST: let it launch, then wait."""
    if GDC == TRIGGER_FIRST_K:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    elif GDC:
        tl.extra.cuda.gdc_wait()
        if GDC != WAIT_ONLY_K:
            tl.extra.cuda.gdc_launch_dependents()
