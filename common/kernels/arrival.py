"""Sums folded into the kernel that writes their terms: the last program to arrive adds them up.

A decode kernel whose programs each write one term of a sum (a GEMV's chunk of K, an expert's share of a MoE
output) used to leave the sum to a kernel of its own. Instead each program, after writing its term, counts
its arrival at its output tile's counter (`arrive`); the program that arrives last reads the terms in their
fixed order and writes the sum — the same additions in the same order as the separate kernel made
(deterministic, bit for bit) — and sets the counter back to zero.

Why: at one row those kernels were 144 of the decode step's ~940 launches (the GEMV's chunk sums 96, the MoE
combine 48), 0.25 ms of its 5.29 exposed at 0292dc6 (decode-allfit-profile.txt), each its launch and ramp for
a few KB.

Memory order (the pattern of a serial split-K reduction): every thread's term written, a CTA barrier, one
atomic add at GPU scope with acquire-release semantics (its release covers what the barrier ordered before
it); Triton broadcasts a scalar atomic's result through shared memory behind a barrier, so the last program's
threads read the terms after its acquire, and they read them past L1 (`.cg`), where no stale line can sit.

Counters: one zeroed buffer per device and stream (`counters`). On one stream a kernel touches its counters
only after `gdc_enter`, when the kernel before it has completed: every counter is back at zero. Streams run
at once (decode groups), so each has its own buffer. KernelConfig.fold_sums False: the separate kernels.
QSA's decode selection (qsa_indexer's rank kernel) also counts arrivals here, the last program writing the
keys from every program's ranks: not a sum, so `fold_sums` leaves it be.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.kernels.config import KERNELS, KernelConfig

ROWS = 1
"""Rows (tokens) up to which the sums fold. On the H200 at one row decode-allfit ran 191.00 tok/s folded
against 188.69 (bench/results/decode-allfit-fold-ab.json) and decode-1 91.48 against 92.14, the second
variant a cache already warmer (decode-1-fold-ab.json); eight lanes (two groups of four) ran 21.16 and 21.14
against 21.55 and 21.37 tok/s a request (decode-8-fold-ab.json): longer kernels, where one launch saved is
worth less than every program's atomic at its tail."""
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
