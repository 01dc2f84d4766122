"""Weights streamed into the GPU's L2 cache ahead of the kernel that reads them (decode steps, Hopper on).

Between a decode step's large GEMVs run chains of small kernels that read almost nothing: Gated DeltaNet's
conv, recurrence and gated norm; QSA's norms, block scores, selection and attention; the router and the
routing replay. The HBM sits idle meanwhile (decode-allfit-mma-profile.txt: a 4.81 ms step against a
~2.4 ms HBM floor). A kernel placed at such a point of the stream issues `cp.async.bulk.prefetch.L2` for a
later kernel's weight: fire and forget, one instruction a chunk, nothing returned to the SM, so it costs the
chain one small launch. The later GEMV then finds its weight in L2 (50 MB on the H100/H200).

Where the prefetch runs (`SIDE`): on a side stream that forks from the step's stream where the weights are
wanted and joins it before their reader (`beside`), so the chain of small kernels does not wait for it; or
in the step's stream, as a kernel taking part in programmatic dependent launch (pdl.py) that waits, then
issues: the next kernel then waits for it to complete, and a grid completes only once its prefetches have
landed (decode-allfit 167.16 tok/s with the "out" site so, against 203.91 without).

Sites (`SITES`), each a decode step's point and the weights it brings:
- "out": the token mixer's output projection (31 MB at flashnext's shape), once its input projection has
  run, during the mixer's small kernels;
- "hc": the next layer's attention hyper-connection (mix-down with inject, and mix-up: 13 MB), once the MoE
  router has run, during the routing, the shared expert and the routed experts.

Graph-safe: shapes alone fix the launch; no host sync.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
import triton
import triton.language as tl
from torch import nn

from common.kernels.pdl import gdc_enter, hopper_or_later, launch
from common.model.fused_linear import FusedLinears

SITES: frozenset[str] = frozenset()
"""Where decode steps prefetch ("out", "hc"; above). Empty until measured on the GPU (the benchmark's
`l2-prefetch-*` switches). Switch before a pass is recorded."""
KNOWN_SITES = frozenset({"out", "hc"})
SIDE = True
"""Prefetch on a side stream beside the step's kernels (False: in the step's stream, the benchmark's
`l2-prefetch-inline` switch)."""
BULK = True
"""Issue `cp.async.bulk.prefetch.L2` a CHUNK (False: `prefetch.global.L2` a 128-byte line, the benchmark's
`l2-prefetch-lines` switch)."""
CHUNK = 8192
"""Bytes a thread prefetches (one bulk instruction, or CHUNK / 128 line prefetches)."""
LANES = 32
"""Threads a program (one warp): a program a 256 KB of weight, so the requests spread over many SMs."""
MAX_ROWS = 16
"""Passes of at most this many rows prefetch (decode steps; a prefill's GEMMs read their weights once at
compute-bound rates)."""
LINE = tl.constexpr(128)
_PREDICATED = "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p %s; mov.u32 $0, 0; }"
"""Inline PTX: a prefetch when the size is positive, and a dummy result (inline asm returns a value)."""
_BULK_ASM = tl.constexpr(_PREDICATED % "cp.async.bulk.prefetch.L2.global [$1], $2")
_LINE_ASM = tl.constexpr(_PREDICATED % "prefetch.global.L2 [$1]")


def wants(site: str, x: torch.Tensor) -> bool:
    """Whether a pass whose activations are x [T, ...] prefetches at `site`."""
    assert site in KNOWN_SITES, site
    if site not in SITES or not x.is_cuda or x.shape[0] > MAX_ROWS:
        return False
    return hopper_or_later(x.device.index)


@contextlib.contextmanager
def beside(site: str, x: torch.Tensor, weights: Callable[[], tuple[torch.Tensor, ...]]) -> Iterator[None]:
    """The with-block's kernels run while `weights()` (one or two tensors) stream into L2, when a pass with
    activations x prefetches at `site` (`wants`): on the side stream, joined at the block's end (SIDE), or
    before the block in the stream."""
    if not wants(site, x):
        yield
        return
    if not SIDE:
        prefetch(*weights())
        yield
        return
    main = torch.cuda.current_stream(x.device)
    side = _side_stream(x.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        prefetch(*weights(), take_part=False)
    yield
    main.wait_stream(side)


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def streamed(linear: nn.Module | FusedLinears) -> torch.Tensor:
    """The tensor a projection's GEMV streams: its weight (fp8: the codes; their scales are small)."""
    codes = getattr(linear, "qweight", None)
    return codes if codes is not None else linear.weight


def programs(nbytes: int) -> int:
    """Programs that prefetch `nbytes` (each LANES chunks of CHUNK bytes)."""
    return triton.cdiv(triton.cdiv(nbytes, CHUNK), LANES)


def prefetch(first: torch.Tensor, second: torch.Tensor | None = None, take_part: bool = True) -> None:
    """Bring one or two contiguous CUDA tensors (their bytes, multiples of 16) into L2, in one launch that
    (`take_part`: in programmatic dependent launch, pdl.py) starts once the kernel before it in the stream
    has completed."""
    second = first if second is None else second
    sizes = [t.numel() * t.element_size() for t in (first, second)]
    assert first.is_contiguous() and second.is_contiguous()
    assert all(n % 16 == 0 for n in sizes), f"bulk prefetches take multiples of 16 bytes, not {sizes}"
    head = programs(sizes[0])
    grid = head + (programs(sizes[1]) if second is not first else 0)
    _prefetch_kernel[(grid,)](
        first.view(torch.uint8), sizes[0], head, second.view(torch.uint8), sizes[1],
        CHUNK=CHUNK, LANES=LANES, BULK=BULK, num_warps=1, **launch(first.device, take_part),
    )  # fmt: skip


@triton.jit
def _prefetch_kernel(
    a_ptr, a_bytes, a_programs, b_ptr, b_bytes,
    CHUNK: tl.constexpr, LANES: tl.constexpr, BULK: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    """Programs [0, a_programs) prefetch a's bytes, the others b's; thread j of a program its CHUNK."""
    gdc_enter(GDC)
    pid = tl.program_id(0)
    if pid < a_programs:
        _issue(a_ptr, a_bytes, pid, CHUNK, LANES, BULK)
    else:
        _issue(b_ptr, b_bytes, pid - a_programs, CHUNK, LANES, BULK)


@triton.jit
def _issue(base, nbytes, pid, CHUNK: tl.constexpr, LANES: tl.constexpr, BULK: tl.constexpr):
    start = (pid * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK  # [LANES] each thread's chunk
    size = tl.minimum(nbytes - start, CHUNK).to(tl.int32)  # ≤ 0 past the end: nothing issued
    if BULK:
        tl.inline_asm_elementwise(
            _BULK_ASM, "=r,l,r", [base + start, size], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    else:
        for line in range(0, CHUNK, LINE):
            tl.inline_asm_elementwise(
                _LINE_ASM, "=r,l,r", [base + start + line, size - line], dtype=tl.int32, is_pure=False,
                pack=1,
            )  # fmt: skip
