"""y = x · Wᵀ (+ bias) for a few rows of x as Triton kernels: the decode step's projections, whose weight's
bytes set the time. W is the model's dtype, or fp8 (e4m3) codes with an fp32 scale per row and 128 inputs
(common/model/fp8_linear.py).

Why not cuBLAS everywhere: at one row its kernels are sized for GEMMs (a split-K kernel and a reduction for a
few MB) and cannot take part in programmatic dependent launch (pdl.py). Here a program owns BN output rows
and one chunk of their inputs, read BK at a time (the first BK before its programmatic wait). With several
chunks, each writes an fp32 partial product and the row tile's last program sums them in order (arrival.py;
from two rows on, or without KernelConfig.fold_sums, a second kernel). Rows of x multiply on the tensor cores
(padded to 16 rows: masked rows cost no bytes) or, below `dot_rows`, as a broadcast and sum. From two rows on
`choose` leaves large weights to cuBLAS.

Graph-safe: no host sync, shapes alone fix the launch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from common.kernels import GEMV_ROWS, arrival
from common.kernels.arrival import arrive, sum_terms
from common.kernels.causal_conv import conv_channels, history_width
from common.kernels.config import KERNELS, KernelConfig
from common.kernels.pdl import gdc_enter, launch

SCALE_BLOCK = 128
"""Inputs per fp8 scale (fp8_linear.BLOCK_K): an fp8 weight's BK is a multiple of it."""
SCALE_K = tl.constexpr(SCALE_BLOCK)
CUBLAS_ROWS = 8192
"""Weights of at least this many output rows stay with cuBLAS from two rows on (bf16; it reads them nearer the
HBM rate than the GEMV does). At one row the GEMV takes them (KernelConfig.large_one_row)."""
FP8_BK = SCALE_BLOCK
"""An fp8 weight's inputs a loop step in `choose`'s launches (but FP8_LARGE_ONE_ROW's), in whole scale blocks.
The codes are scaled in registers before the dot."""
PROGRAMS = 4
"""Programs an SM that `choose` aims for (enough loads in flight)."""


@dataclass(frozen=True)
class GemvConfig:
    """One launch's shape (bench/gemv_tune.py measures them)."""

    bn: int = 16
    """Output rows a program."""
    bk: int = 512
    """Inputs a loop step (for an fp8 weight whole scale blocks of 128)."""
    splits: int = 1
    """Chunks K is cut into, one program each (then a second kernel sums them)."""
    warps: int = 4
    """Warps a program."""
    stages: int = 2
    """Loop steps whose loads are in flight at once."""
    dot_rows: int = 1
    """From this many rows of x on, the tensor cores multiply (below: broadcast and sum)."""


FP8_LARGE_ONE_ROW: GemvConfig | None = GemvConfig(bn=64, bk=256, splits=1, stages=3)
"""At one row, the launch for an fp8 weight of CUBLAS_ROWS rows and more (the token mixers' input
projections: `wide_fp8`), or None: `choose`'s one block a step. 64 rows and two scale blocks a step, the codes
scaled in registers. Its programs are one wave of large ones, which in PDL become resident while the kernel
before still holds SMs: it pays only when that kernel, the hyper-connection's mix-up, lets it launch at its
exit (KernelConfig.hold_mixer_launch). Switch before a pass is recorded."""


@dataclass(frozen=True)
class ConvStep:
    """The causal conv (dilation 1, SiLU'd) `gemv` applies to its first C outputs, one token: each output
    convolved with its history, the history shifted in place with the raw output appended, as
    causal_conv.conv_step does after the GEMV."""

    history: torch.Tensor
    """[S, C, K − 1], the token's at slots[0]."""
    slots: torch.Tensor
    """[1] the token's slot."""
    weight: torch.Tensor
    """[C, K] the conv's taps, the new input's last."""

    def args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
        """The kernel's (history, slots, weight, channels, width)."""
        width = history_width(self.history, self.weight, 1)
        return self.history, self.slots, self.weight.contiguous(), self.weight.shape[0], width


def large_one_row(m: int, n: int) -> bool:
    """Whether x [m, k] · W [n, k]ᵀ is one row of a weight of CUBLAS_ROWS rows and more (the token mixers'
    input projections in a one-lane step): LARGE_ONE_ROW's and FP8_LARGE_ONE_ROW's launches."""
    return m == 1 and n >= CUBLAS_ROWS


def wide_fp8(m: int, n: int, kernels: KernelConfig = KERNELS) -> bool:
    """Whether x [m, k] · W [n, k]ᵀ with W fp8 runs FP8_LARGE_ONE_ROW's launch (with
    KernelConfig.fp8_large_one_row)."""
    return large_one_row(m, n) and kernels.fp8_large_one_row


def choose(
    m: int, n: int, k: int, device: torch.device, fp8: bool = False, kernels: KernelConfig = KERNELS
) -> GemvConfig | None:
    """The launch shape for x [m, k] · W [n, k]ᵀ, or None: cuBLAS (a large bf16 weight; at one row with
    KernelConfig.large_one_row, one chunk a program)."""
    if n >= CUBLAS_ROWS and not fp8:
        one_chunk = large_one_row(m, n) and kernels.large_one_row
        return GemvConfig(bn=32, bk=512, splits=1) if one_chunk else None
    if fp8 and wide_fp8(m, n, kernels):
        return FP8_LARGE_ONE_ROW
    dot = m >= GemvConfig.dot_rows  # tensor cores: wider tiles, shorter steps (gemv-tune.txt)
    bn, bk = (32, 256) if dot else (16, 512)  # each form's best in bench.gemv_tune
    bk = FP8_BK if fp8 else min(bk, max(16, triton.next_power_of_2(k)))  # a dot's K: at least 16
    steps = triton.cdiv(k, bk)
    # From two rows on, a chunk of one step loses: the sums' kernel reads splits × rows partial products.
    splits = min(
        steps if m == 1 else triton.cdiv(steps, 2), triton.cdiv(PROGRAMS * _sms(device), triton.cdiv(n, bn))
    )
    chunk, splits = chunks(k, bk, max(1, splits))
    # A one-step chunk has no loop to pipeline: one stage.
    return GemvConfig(bn=bn, bk=bk, splits=splits, stages=1 if chunk <= bk else 2)


def chunks(k: int, bk: int, splits: int) -> tuple[int, int]:
    """K cut into about `splits` chunks of whole BK steps → (inputs a chunk, chunks)."""
    chunk = triton.cdiv(triton.cdiv(k, splits), bk) * bk
    return chunk, triton.cdiv(k, chunk)


def scale_blocks(cfg: GemvConfig) -> int:
    """Scale blocks an fp8 weight's loop step spans under `cfg`, or 0 where that launch cannot take an fp8
    weight (BK not whole blocks). Past one block `_step` scales the codes in registers before the product."""
    blocks, whole = divmod(cfg.bk, SCALE_BLOCK)
    return blocks if blocks and not whole else 0


@functools.cache
def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: any count
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, part_ptr, y_ptr, count_ptr, m, n, k, k_chunk,
    hist_ptr, slots_ptr, conv_w_ptr, conv_channels_n, conv_width,
    M_PAD: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, FOLD: tl.constexpr,
    PRECISION: tl.constexpr, CONV_K: tl.constexpr, CONV_BW: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    outs = tl.program_id(0) * BN + tl.arange(0, BN)  # [BN] output features
    live_n = outs < n
    k_lo = tl.program_id(1) * k_chunk
    k_hi = tl.minimum(k_lo + k_chunk, k)
    r = tl.arange(0, M_PAD)
    live_m = r < m
    w_rows = w_ptr + outs[:, None].to(tl.int64) * k  # [BN, 1]
    cols = k_lo + tl.arange(0, BK)
    live_k = (cols < k_hi) | EVEN_K
    # The first step's weights [BN, BK] are read before the wait (no kernel writes them); x is the kernel
    # before's output.
    w = tl.load(w_rows + cols[None, :], mask=live_n[:, None] & live_k[None, :], other=0.0)
    gdc_enter(GDC)
    acc = _step(
        x_ptr, w, s_ptr, r, live_m, cols, live_k, outs, live_n, k, k_lo, BK, DOT, HAS_SCALE, PRECISION
    )
    for k0 in range(k_lo + BK, k_hi, BK):
        cols = k0 + tl.arange(0, BK)
        live_k = (cols < k_hi) | EVEN_K
        w = tl.load(w_rows + cols[None, :], mask=live_n[:, None] & live_k[None, :], other=0.0)
        acc += _step(
            x_ptr, w, s_ptr, r, live_m, cols, live_k, outs, live_n, k, k0, BK, DOT, HAS_SCALE, PRECISION
        )
    out = r[:, None] * n + outs[None, :]  # [M_PAD, BN] flat (row, output) of y
    live = live_m[:, None] & live_n[None, :]
    if CONV_K:  # one row, one chunk (gemv's `conv`)
        _finish_conv(
            acc, r, outs, live_n, y_ptr, hist_ptr, slots_ptr, conv_w_ptr, conv_channels_n, conv_width,
            BN, CONV_K, CONV_BW,
        )  # fmt: skip
    elif not PARTIAL:
        _finish(acc, b_ptr, y_ptr, out, n, live, HAS_BIAS)
    else:  # this chunk's product: [splits, m, n] fp32
        tl.store(part_ptr + tl.program_id(1) * m * n + out, acc, mask=live)
        if FOLD:  # noqa: SIM102 (a constexpr: no arrival compiled without it) the last chunk sums them all
            if arrive(count_ptr + tl.program_id(0), tl.num_programs(1)):
                acc = sum_terms(part_ptr, out, live, m * n, tl.num_programs(1))
                _finish(acc, b_ptr, y_ptr, out, n, live, HAS_BIAS)


@triton.jit
def _step(
    x_ptr, w, s_ptr, r, live_m, cols, live_k, outs, live_n, k, k0,
    BK: tl.constexpr, DOT: tl.constexpr, HAS_SCALE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """x's rows at `cols` times the weight tile w [BN, BK] (scaled per row and block: fp8) → [M_PAD, BN]."""
    x = tl.load(x_ptr + r[:, None] * k + cols[None, :], mask=live_m[:, None] & live_k[None, :], other=0.0)
    blocks: tl.constexpr = BK // SCALE_K
    if HAS_SCALE and blocks > 1:  # each 128 inputs' scale on the codes, before the product
        w = _dequantize(w, s_ptr, outs, live_n, k, k0, BK)
    if DOT:
        part = tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)
    else:
        part = tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if HAS_SCALE and blocks == 1:  # one scale a row: on the product
        scale = tl.load(
            s_ptr + outs.to(tl.int64) * tl.cdiv(k, SCALE_K) + k0 // SCALE_K, mask=live_n, other=0.0
        )
        part = part * scale[None, :]
    return part


@triton.jit
def _dequantize(w, s_ptr, outs, live_n, k, k0, BK: tl.constexpr):
    """fp8 codes w [BN, BK] → the weight in fp32, each row's 128-input blocks times their scales."""
    blocks: tl.constexpr = BK // SCALE_K
    per_row = tl.cdiv(k, SCALE_K)
    b = k0 // SCALE_K + tl.arange(0, blocks)  # [blocks] this step's scale blocks
    at = outs.to(tl.int64)[:, None] * per_row + b[None, :]
    scale = tl.load(s_ptr + at, mask=live_n[:, None] & (b < per_row)[None, :], other=0.0)  # [BN, blocks]
    w3 = tl.reshape(w.to(tl.float32), (w.shape[0], blocks, SCALE_K)) * scale[:, :, None]
    return tl.reshape(w3, (w.shape[0], BK))


@triton.jit
def _finish(acc, b_ptr, y_ptr, i, n, live, HAS_BIAS: tl.constexpr):
    """y at flat indices i (row · n + output) ← acc (+ the bias), in y's dtype."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + i % n, mask=live, other=0.0).to(tl.float32)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=live)


@triton.jit
def _finish_conv(
    acc, r, outs, live_n, y_ptr, hist_ptr, slots_ptr, w_ptr, channels, width,
    BN: tl.constexpr, K: tl.constexpr, BW: tl.constexpr,
):  # fmt: skip
    """y[outs] ← row 0 of acc [M_PAD, BN], its outputs below `channels` through the causal conv of
    causal_conv.conv_step (SiLU'd; the history takes them as y would hold them)."""
    y = tl.sum(tl.where(r[:, None] == 0, acc, 0.0), axis=0)  # [BN]
    y = y.to(y_ptr.dtype.element_ty).to(tl.float32)  # as stored: what the history keeps
    if tl.program_id(0) * BN < channels:
        slot = tl.load(slots_ptr).to(tl.int64)
        convolved = outs < channels
        conv = conv_channels(
            y, hist_ptr, slot, w_ptr, outs, live_n & convolved, channels, width, K, 1, BW, True
        )
        y = tl.where(convolved, conv, y)
    tl.store(y_ptr + outs, y.to(y_ptr.dtype.element_ty), mask=live_n)


@triton.jit
def _sum_chunks_kernel(
    part_ptr, b_ptr, y_ptr, m, n, splits, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, GDC: tl.constexpr
):  # fmt: skip
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] flat (row, output) of y
    live = i < m * n
    gdc_enter(GDC)
    _finish(sum_terms(part_ptr, i, live, m * n, splits), b_ptr, y_ptr, i, n, live, HAS_BIAS)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    conv: ConvStep | None = None,
    kernels: KernelConfig = KERNELS,
) -> torch.Tensor:
    """x [M ≤ 16, K] · weightᵀ (+ bias [N]) → [M, N] in x's dtype. weight [N, K] contiguous: x's dtype, or
    e4m3 codes with `scale` [N, ⌈K/128⌉] fp32 (one per row and 128 inputs). `config` None: `choose`'s, or
    one setting (fp8) when that is cuBLAS. With `conv` (one row, no bias), the first C outputs come out
    convolved as `ConvStep` says, in one chunk a program. `kernels`: the launch options (programmatic
    dependent launch, the folded sum)."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= GEMV_ROWS, f"{m} rows: at most {GEMV_ROWS} (larger batches run a GEMM)"
    cfg = config or choose(m, n, k, x.device, scale is not None, kernels) or GemvConfig()
    if conv is not None:
        assert m == 1 and bias is None and conv.weight.shape[0] <= n, (m, bias is None, conv.weight.shape, n)
        cfg = replace(cfg, splits=1)  # the epilogue needs each row's whole sum
    bk = cfg.bk
    dot = m >= cfg.dot_rows
    assert scale is None or scale_blocks(cfg), f"an fp8 weight's BK is whole scale blocks, not {bk}"
    chunk, splits = chunks(k, bk, cfg.splits)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else y
    bias_arg = bias if bias is not None else weight
    tiles = triton.cdiv(n, cfg.bn)
    fold = splits > 1 and arrival.folds(m, kernels)
    hist, slots, conv_w, channels, width = (y, y, y, 0, 1) if conv is None else conv.args()
    _gemv_kernel[(tiles, splits)](
        x.contiguous(), weight, scale if scale is not None else weight, bias_arg, part, y,
        arrival.counters(x.device, tiles) if fold else y, m, n, k, chunk,
        hist, slots, conv_w, channels, width,
        M_PAD=GEMV_ROWS if dot else triton.next_power_of_2(max(m, 1)), BN=cfg.bn, BK=bk, DOT=dot,
        EVEN_K=k % chunk == 0 and chunk % bk == 0, HAS_SCALE=scale is not None, HAS_BIAS=bias is not None,
        PARTIAL=splits > 1, FOLD=fold, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        CONV_K=0 if conv is None else conv.weight.shape[1], CONV_BW=triton.next_power_of_2(width),
        num_warps=cfg.warps, num_stages=cfg.stages, **launch(x.device, kernels.gemv_pdl, kernels=kernels),
    )  # fmt: skip
    if splits > 1 and not fold:
        block = 256
        _sum_chunks_kernel[(triton.cdiv(m * n, block),)](
            part,
            bias_arg,
            y,
            m,
            n,
            splits,
            BLOCK=block,
            HAS_BIAS=bias is not None,
            **launch(x.device, kernels=kernels),
        )
    return y
