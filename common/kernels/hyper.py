"""Hyper-connection elementwise work as Triton kernels (common/model/qwen4_exp/hyper.py).

- `hc_norm`: streams [T, hc·H] → normed, each stream RMS-normalised on its own, weight (1 + w);
- `hc_mix`: (up [T, hc·H] logits, normed) → Σ_s σ(up_s)·normed_s / hc  [T, H];
- `hc_inject`: (streams, sublayer output [T, H], inject logits [T, hc]) → streams + out ⊗ 2σ(inject / hc);
  the logits may be a strided view or hc_project's partial products.
- `hc_mix_up` (decode rows): `hc_mix` with up = W_up · silu(down / hc) computed in registers; W_up
  [hc·H, rank] read once, up never written.
- `hc_project` (decode rows): the mix-down and inject projection of the streams, normalised as read, as one
  partial product a stream.

`hc_project`, `hc_mix_up` and `hc_inject` take part in programmatic dependent launch (pdl.py). Computed in
fp32 and rounded once to the streams' dtype: agrees with torch to bf16 rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.kernels.config import KERNELS, KernelConfig
from common.kernels.pdl import gdc_enter, launch


@triton.jit
def _norm_kernel(x_ptr, w_ptr, out_ptr, hidden, eps, BLOCK: tl.constexpr):
    t, s = tl.program_id(0), tl.program_id(1)
    streams = tl.num_programs(1)
    i = tl.arange(0, BLOCK)
    live = i < hidden
    at = (t * streams + s) * hidden + i
    x = tl.load(x_ptr + at, mask=live, other=0.0).to(tl.float32)
    x = x * tl.math.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    w = tl.load(w_ptr + s * hidden + i, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + at, (x * (1.0 + w)).to(out_ptr.dtype.element_ty), mask=live)


@triton.jit
def _mix_kernel(up_ptr, normed_ptr, out_ptr, hidden, HC: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = i < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(HC):
        at = (t * HC + s) * hidden + i
        gate = tl.sigmoid(tl.load(up_ptr + at, mask=live, other=0.0).to(tl.float32))
        acc += gate * tl.load(normed_ptr + at, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * hidden + i, (acc / HC).to(out_ptr.dtype.element_ty), mask=live)


@triton.jit
def _inject_kernel(
    x_ptr, y_ptr, inject_ptr, out_ptr, hidden, inject_stride, part_stride,
    HC: tl.constexpr, BLOCK: tl.constexpr, PARTS: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = i < hidden
    gdc_enter(GDC)
    y = tl.load(y_ptr + t * hidden + i, mask=live, other=0.0).to(tl.float32)
    for s in range(HC):
        weight = _inject_weight(inject_ptr, t, s, inject_stride, part_stride, HC, PARTS)
        at = (t * HC + s) * hidden + i
        x = tl.load(x_ptr + at, mask=live, other=0.0).to(tl.float32)
        tl.store(out_ptr + at, (x + y * weight).to(out_ptr.dtype.element_ty), mask=live)


@triton.jit
def _inject_weight(inject_ptr, t, s, inject_stride, part_stride, HC: tl.constexpr, PARTS: tl.constexpr):
    """Stream s's injection weight 2σ(logit / hc) for row t, the logit summed from its partial products in
    order (the same sum in every kernel that applies an injection)."""
    logit = 0.0
    for p in range(PARTS):  # hc_project's partial products
        logit += tl.load(inject_ptr + p * part_stride + t * inject_stride + s).to(tl.float32)
    return 2.0 * tl.sigmoid(logit / HC)


def hc_norm(streams: torch.Tensor, weight: torch.Tensor, eps: float, hc: int) -> torch.Tensor:
    """streams [T, hc·H] → each stream x · rsqrt(mean(x²) + eps) · (1 + w_s), in the streams' dtype."""
    t, width = streams.shape
    hidden = width // hc
    out = torch.empty_like(streams)
    _norm_kernel[(t, hc)](
        streams.contiguous(), weight, out, hidden, eps, BLOCK=triton.next_power_of_2(hidden)
    )
    return out


def hc_mix(up: torch.Tensor, normed: torch.Tensor, hc: int, block: int = 1024) -> torch.Tensor:
    """The sublayer input: mean over streams of σ(up_s) · normed_s, [T, H] in normed's dtype."""
    t, width = normed.shape
    hidden = width // hc
    out = torch.empty((t, hidden), dtype=normed.dtype, device=normed.device)
    _mix_kernel[(t, triton.cdiv(hidden, block))](
        up.contiguous(), normed.contiguous(), out, hidden, HC=hc, BLOCK=block
    )
    return out


@triton.jit
def _mix_up_kernel(
    down_ptr, w_ptr, x_ptr, scale_ptr, nw_ptr, out_ptr, hidden, rank, down_stride, part_stride,
    HC: tl.constexpr, BLOCK: tl.constexpr, R_PAD: tl.constexpr, R_TAIL: tl.constexpr, NORM: tl.constexpr,
    PARTS: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] hidden columns
    live = i < hidden
    r = tl.arange(0, R_PAD)  # the rank's first R_PAD, then (R_TAIL) the rest in a tile of its own
    s = tl.arange(0, HC)  # every stream's rows in one tile: all of a program's weight loads in flight at once
    rows = s[:, None] * hidden + i[None, :]  # [HC, BLOCK]
    # No kernel writes the weights: loaded before the wait.
    w = _up_tile(w_ptr, rows, live, r, rank)  # [HC, BLOCK, R_PAD]
    if R_TAIL:
        r_tail = R_PAD + tl.arange(0, R_TAIL)
        w_tail = _up_tile(w_ptr, rows, live, r_tail, rank)  # [HC, BLOCK, R_TAIL]
    if NORM:
        nw = tl.load(nw_ptr + rows, mask=live[None, :], other=0.0).to(tl.float32)
    gdc_enter(GDC)
    # Every read of the kernel before's outputs issued at once (one round trip, not one before the gate's
    # sum and one after it).
    x = tl.load(x_ptr + t * HC * hidden + rows, mask=live[None, :], other=0.0).to(tl.float32)
    if NORM:  # x is the raw streams: their norm here, from the scales hc_project wrote
        x = x * tl.load(scale_ptr + t * HC + s)[:, None] * (1.0 + nw)
    d = _silu_down(down_ptr + t * down_stride, part_stride, r, rank, HC, PARTS)  # [R_PAD]
    up = tl.sum(w.to(tl.float32) * d[None, None, :], axis=2)  # [HC, BLOCK]
    if R_TAIL:
        d_tail = _silu_down(down_ptr + t * down_stride, part_stride, r_tail, rank, HC, PARTS)
        up += tl.sum(w_tail.to(tl.float32) * d_tail[None, None, :], axis=2)
    gate = tl.sigmoid(up)  # σ(up)
    acc = tl.sum(gate * x, axis=0)
    tl.store(out_ptr + t * hidden + i, (acc / HC).to(out_ptr.dtype.element_ty), mask=live)


@triton.jit
def _up_tile(w_ptr, rows, live, r, rank):
    """The mix-up weight's rows `rows` [HC, BLOCK] (live columns `live`) at rank indices r: [HC, BLOCK, R]."""
    at = rows[:, :, None] * rank + r[None, None, :]
    return tl.load(w_ptr + at, mask=live[None, :, None] & (r < rank)[None, None, :], other=0.0)


@triton.jit
def _silu_down(down_row, part_stride, r, rank, HC: tl.constexpr, PARTS: tl.constexpr):
    """silu(down / hc) at rank indices r, down the sum of hc_project's PARTS partial products."""
    d = tl.zeros(r.shape, dtype=tl.float32)
    for p in range(PARTS):  # hc_project's partial products, one a stream
        d += tl.load(down_row + p * part_stride + r, mask=r < rank, other=0.0).to(tl.float32)
    d = d / HC
    return d / (1.0 + tl.exp(-d))


def pow2_tiles(n: int, split: bool) -> tuple[int, int]:
    """The tiles a kernel covers n elements with: (n's next power of two, 0), or with `split` n's largest
    power of two and the rest's next power of two (0 when nothing is left)."""
    if not split:
        return triton.next_power_of_2(n), 0
    head = 1 << (n.bit_length() - 1)
    return head, triton.next_power_of_2(n - head) if n > head else 0


MIX_UP_ROWS = 1
"""Rows up to which `hc_mix_up` (and `hc_project` before it) run; past it, hc_norm, cuBLAS and `hc_mix`. Each
program multiplies one row, the weights' tiles coming from L2 for the others, so more rows pay for the tiles
again."""


def hc_mix_up(
    down: torch.Tensor,
    weight_up: torch.Tensor,
    x: torch.Tensor,
    hc: int,
    block: int = 8,
    scales: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    num_warps: int = 4,
    hold_next: bool = False,
    kernels: KernelConfig = KERNELS,
) -> torch.Tensor:
    """down [T, R] (rows may be strided: a view of a fused projection's output; or [P, T, R], partial
    products summed here), weight_up [hc·H, R], x the normalised streams [T, hc·H] →
    Σ_s σ((W_up · silu(down / hc))_s) · x_s / hc, [T, H] in x's dtype. With `scales` [T, hc] (hc_project's)
    and the norm's `norm_weight` [hc·H], x is the raw streams, normalised here as hc_norm would
    (x · scale · (1 + w)). `hold_next`: the next kernel launches only at this one's exit (pdl.launch).
    `kernels.mix_up_split_rank`: the rank in two power-of-two tiles, else one padded."""
    parts = down if down.dim() == 3 else down[None]  # [P, T, R]
    _, t, rank = parts.shape
    hidden = x.shape[1] // hc
    assert parts.stride(2) == 1 and weight_up.is_contiguous() and weight_up.shape == (hc * hidden, rank)
    assert hc & (hc - 1) == 0  # the streams are one tile's rows
    norm = scales is not None
    head, tail = pow2_tiles(rank, kernels.mix_up_split_rank)
    out = torch.empty((t, hidden), dtype=x.dtype, device=x.device)
    _mix_up_kernel[(t, triton.cdiv(hidden, block))](
        parts, weight_up, x.contiguous(), scales if norm else x, norm_weight if norm else x, out, hidden,
        rank, parts.stride(1), parts.stride(0), HC=hc, BLOCK=block, R_PAD=head, R_TAIL=tail, NORM=norm,
        PARTS=parts.shape[0], num_warps=num_warps, **launch(x.device, hold_next=hold_next, kernels=kernels),
    )  # fmt: skip
    return out


@triton.jit
def _project_kernel(
    x_ptr, nw_ptr, w_ptr, out_ptr, scale_ptr, rows, n_out, eps,
    y_ptr, inject_ptr, new_ptr, inject_stride, part_stride,
    HC: tl.constexpr, H: tl.constexpr, H_PAD: tl.constexpr, BN: tl.constexpr, INJECT: tl.constexpr,
    PARTS: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    t, nb, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = nb * BN + tl.arange(0, BN)  # [BN] output columns
    live_n = n < n_out
    k = tl.arange(0, H_PAD)  # the whole stream: one read, no loop
    live_k = k < H
    at = n[:, None] * (HC * H) + s * H + k[None, :]  # [BN, H_PAD]
    w = tl.load(
        w_ptr + at, mask=live_n[:, None] & live_k[None, :], other=0.0
    )  # no kernel writes the weights:
    nw = tl.load(nw_ptr + s * H + k, mask=live_k, other=0.0).to(tl.float32)  # loaded before the wait
    gdc_enter(GDC)
    weight = 0.0
    if INJECT:  # the streams are x + y ⊗ 2σ(logit / hc), hc_inject's, applied as they are read
        weight = _inject_weight(inject_ptr, t, s, inject_stride, part_stride, HC, PARTS)
    xs = _stream_block(x_ptr + (t * HC + s) * H, y_ptr + t * H, k, weight, new_ptr, H, INJECT)  # [H_PAD]
    if INJECT:  # noqa: SIM102  (a static branch around a runtime one)
        if nb == 0:  # one program a stream writes the injected streams: hc_mix_up and hc_inject read them
            tl.store(new_ptr + (t * HC + s) * H + k, xs.to(new_ptr.dtype.element_ty), mask=live_k)
    scale = tl.math.rsqrt(tl.sum(xs * xs, axis=0) / H + eps)
    tl.store(scale_ptr + t * HC + s, scale, mask=nb == 0)
    acc = tl.sum(w.to(tl.float32) * (xs * (1.0 + nw))[None, :], axis=1) * scale  # the norm's scale after
    tl.store(out_ptr + (s * rows + t) * n_out + n, acc, mask=live_n)


@triton.jit
def _stream_block(stream, y_row, cols, weight, new_ptr, H: tl.constexpr, INJECT: tl.constexpr):
    """A stream's values at `cols` (those ≥ H read as 0) in fp32; with INJECT, the injection's, rounded to
    the streams' dtype as hc_inject stores them (the same values, so the same products)."""
    live = cols < H
    xs = tl.load(stream + cols, mask=live, other=0.0).to(tl.float32)
    if INJECT:
        y = tl.load(y_row + cols, mask=live, other=0.0).to(tl.float32)
        xs = (xs + y * weight).to(new_ptr.dtype.element_ty).to(tl.float32)
    return xs


PROJECT_TILE = 16384
"""Most weight elements a `hc_project` program holds in registers ([block_n, H] padded); a wider stream takes
fewer columns a program."""
PROJECT_WARPS = 2
"""Warps a `hc_project` program: few, long-lived threads whose weight tile is all in flight before the
programmatic wait."""


def hc_project(
    streams: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, hc: int,
    block_n: int = 4, num_warps: int = PROJECT_WARPS, inject: tuple[torch.Tensor, torch.Tensor] | None = None,
    kernels: KernelConfig = KERNELS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """A few rows' hyper-connection input projection from the raw streams [T, hc·H]: hc_norm's normalised
    streams (weight (1 + norm_weight)) times weight [N, hc·H]ᵀ → (partial products a stream [hc, T, N] fp32,
    whose sum is the product, added by hc_mix_up and hc_inject as they read them; each stream's scale
    rsqrt(mean(x²) + eps) [T, hc] fp32; the streams). A program a stream and `block_n` columns (fewer for a
    stream wider than PROJECT_TILE / block_n). Each program loads its weight tile before its programmatic wait
    (pdl.py), then reads its stream once: the scale multiplies the product after the sum.

    `inject` (the previous sublayer's output [T, H] and its inject logits, as hc_inject takes them): the
    streams are first `hc_inject(streams, *inject)`, applied as read and written back (the streams
    returned), with hc_inject's values."""
    t, width = streams.shape
    n_out = weight.shape[0]
    assert weight.is_contiguous() and weight.shape[1] == width and width % hc == 0
    h_pad = triton.next_power_of_2(width // hc)
    assert h_pad <= PROJECT_TILE, f"streams of {width // hc}: at most {PROJECT_TILE}"
    block_n = min(block_n, PROJECT_TILE // h_pad)
    out = torch.empty((hc, t, n_out), dtype=torch.float32, device=streams.device)
    scales = torch.empty((t, hc), dtype=torch.float32, device=streams.device)
    streams = streams.contiguous()
    if inject is not None:
        y, parts = inject[0].contiguous(), _inject_parts(inject[1])
        new = torch.empty_like(streams)
    else:
        y, parts, new = streams, streams[None], streams  # (unread without INJECT)
    _project_kernel[(t, triton.cdiv(n_out, block_n), hc)](
        streams, norm_weight, weight, out, scales, t, n_out, eps, y, parts, new, parts.stride(1),
        parts.stride(0), HC=hc, H=width // hc, H_PAD=h_pad, BN=block_n, INJECT=inject is not None,
        PARTS=parts.shape[0], num_warps=num_warps, **launch(streams.device, kernels=kernels),
    )  # fmt: skip
    return out, scales, new


def _inject_parts(logits: torch.Tensor) -> torch.Tensor:
    """Inject logits [T, hc] (may be a strided view) or partial products [P, T, hc] as [P, T, hc]."""
    parts = logits if logits.dim() == 3 else logits[None]
    assert parts.stride(2) == 1
    return parts


def hc_inject(
    streams: torch.Tensor,
    out: torch.Tensor,
    inject: torch.Tensor,
    block: int = 1024,
    kernels: KernelConfig = KERNELS,
) -> torch.Tensor:
    """streams [T, hc·H] + the sublayer's out [T, H] weighted per stream by 2σ(inject [T, hc] / hc); inject
    may be a strided view (a fused projection's last columns) or [P, T, hc] partial products, summed here."""
    parts = _inject_parts(inject)
    _, t, hc = parts.shape
    hidden = out.shape[1]
    new = torch.empty_like(streams)
    _inject_kernel[(t, triton.cdiv(hidden, block))](
        streams.contiguous(), out.contiguous(), parts, new, hidden, parts.stride(1), parts.stride(0), HC=hc,
        BLOCK=block, PARTS=parts.shape[0], **launch(streams.device, kernels=kernels),
    )  # fmt: skip
    return new
