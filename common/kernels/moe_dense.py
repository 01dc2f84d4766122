"""Decode MoE over experts read in place from their pool rows, in any dense format: bf16, fp8 (128×128
block scales), 4-bit floats (NVFP4, MXFP4, compressed-tensors' NVFP4), published int4 (GPTQ, AWQ,
compressed-tensors' pack-quantized) and trellis codes.

Each pair's weights are read once (torch would gather the chosen rows into a new tensor), in the int4
kernels' two-kernel structure:

1. gate/up: program (pair p, block of I columns) → silu(gate) · up in fp32, act [P, I].
2. down: program (pair p, block of H rows) → act[p] · down^T times the routing weight, partial [P, H] fp32,
   summed over each token's k choices by the caller (a fixed order).

`weight_tile` decodes a [rows, 128] tile of any format in registers (the layouts: common/experts/formats.py
and the block modules of common/model/); NVFP4s' global scales apply after the sum. A trellis pool's
rotations are taken around the two kernels (`Mixing`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BK = tl.constexpr(128)
"""Inputs per loop step (the fp8 scale block)."""
BF16, FP8, NVFP4, MXFP4, CT_NVFP4, GPTQ, AWQ, CT_INT4, CT_INT4_ZP, TRELLIS = range(10)
"""The pool's layout (the kernels' `FMT`): 4-bit floats 2..4, int4 5..8, trellis codes 9."""
MUL0, ADD0 = tl.constexpr(0x9E3779B1), tl.constexpr(0x7F4A7C15)
MUL1, ADD1 = tl.constexpr(0x85EBCA77), tl.constexpr(0xC2B2AE3D)
"""The trellis codebook's two hashes of a state (trellis_blocks.py's; the tests hold them equal)."""
IRWIN_HALL_STD = tl.constexpr(147.80054127099805)
"""The standard deviation of a sum of four uniform bytes."""


@triton.jit
def _e2m1_pairs(byte):
    """Bytes of two 4-bit e2m1 codes (int32) → (low nibble's, high nibble's) fp32 values × 2⁻¹⁴: a code's
    sign and magnitude bits placed in an fp16's (exponent 2 bits, mantissa 1; e = 0 a subnormal) and
    converted exactly, no table, no exp2."""
    low = ((byte & 7) << 9) | ((byte & 8) << 12)
    high = ((byte & 0x70) << 5) | ((byte & 0x80) << 8)
    low = low.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return low, high.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


FP4_UNIT = tl.constexpr(16384.0)
"""2¹⁴: what `_e2m1_pairs`' values are short of."""


@triton.jit
def _fp4_scale(b, FMT: tl.constexpr):
    """Block scale bytes (int32) → fp32: e4m3 (NVFP4s; finite codes) or e8m0, 2^(b − 127) (MXFP4)."""
    if FMT == 3:
        return tl.exp2((b - 127).to(tl.float32))
    e = (b >> 3) & 15
    m = (b & 7).to(tl.float32)
    magnitude = tl.where(e == 0, m * 0.001953125, (1.0 + m * 0.125) * tl.exp2((e - 7).to(tl.float32)))
    return tl.where(b >= 128, -magnitude, magnitude)  # 0.001953125 = 2^-9: subnormal m/8 · 2^-6


@triton.jit
def _fp4_groups(w_ptr, s_ptr, rows, live_rows, k0, width, FMT: tl.constexpr):
    """One step of BK inputs of 4-bit float rows [BLOCK, 1] (int64), by block-scale group: (low, high)
    nibbles' values × 2⁻¹⁴ [BLOCK, NG, G/2] (input k0 + g·G + 2j and the one after; 0 past `width` and in
    dead rows), the groups' scales [BLOCK, NG] fp32 and the inputs' group and pair indices."""
    group: tl.constexpr = 32 if FMT == 3 else 16
    ng: tl.constexpr = BK // group
    g = tl.arange(0, ng)[:, None]  # [NG, 1]
    j = tl.arange(0, group // 2)[None, :]  # [1, G/2]
    live_g = (k0 + g * group < width) & live_rows[:, None, None]  # [BLOCK, NG, 1]
    byte_at = rows[:, :, None] * (width // 2) + (k0 // 2 + g * (group // 2) + j)[None, :, :]
    byte = tl.load(w_ptr + byte_at, mask=live_g, other=0).to(tl.int32)  # [BLOCK, NG, G/2]
    low, high = _e2m1_pairs(byte)
    gs = k0 // group + tl.arange(0, ng)  # [NG]
    live_s = live_rows[:, None] & (gs * group < width)[None, :]
    b = tl.load(s_ptr + rows * (width // group) + gs[None, :], mask=live_s, other=0).to(tl.int32)
    return low, high, _fp4_scale(b, FMT), g, j


@triton.jit
def _fp4_tile(w_ptr, s_ptr, rows, live_rows, k0, width, FMT: tl.constexpr):
    """4-bit float weights [BLOCK, BK] fp32 (`weight_tile`'s): each pair of nibbles joined back in input
    order, times its group's scale."""
    low, high, scale, _, _ = _fp4_groups(w_ptr, s_ptr, rows, live_rows, k0, width, FMT)
    scale = (scale * FP4_UNIT)[:, :, None]
    pairs = tl.join(low * scale, high * scale)  # [BLOCK, NG, G/2, 2]
    return tl.reshape(pairs, (low.shape[0], BK))


@triton.jit
def _fp4_dot(w_ptr, s_ptr, x_ptr, rows, live_rows, k0, width, FMT: tl.constexpr):
    """Σ_j w[rows, k0 + j] · x[k0 + j] over one step of BK inputs of 4-bit float rows → [BLOCK] fp32 × 2⁻¹⁴:
    the nibbles multiply the even and odd inputs apart, each group's sum times its scale once."""
    low, high, scale, g, j = _fp4_groups(w_ptr, s_ptr, rows, live_rows, k0, width, FMT)
    group: tl.constexpr = 32 if FMT == 3 else 16
    c = k0 + g * group + 2 * j  # [NG, G/2] the even inputs
    x_even = tl.load(x_ptr + c, mask=c < width, other=0.0).to(tl.float32)
    x_odd = tl.load(x_ptr + c + 1, mask=c < width, other=0.0).to(tl.float32)
    dot = tl.sum(low * x_even[None, :, :] + high * x_odd[None, :, :], axis=2)  # [BLOCK, NG]
    return tl.sum(dot * scale, axis=1)


@triton.jit
def _int4_tile(
    w_ptr, s_ptr, z_ptr, a_ptr, r, c, live, width, total, groups, FMT: tl.constexpr, PARAM: tl.constexpr
):
    """Int4 weights [BLOCK, BK] fp32 of output rows r [BLOCK, 1] (int64, of the stored matrix's `total`)
    and inputs c [1, BK] (of `width`), in `groups` groups; `a_ptr`: GPTQ's g_idx row; PARAM: what a stored
    GPTQ zero lacks (v1: 1)."""
    if FMT == 5:  # GPTQ: qweight [in/8, out], qzeros [G, out/8], scales [G, out]; group g_idx[c]
        g = tl.load(a_ptr + c, mask=c < width, other=0).to(tl.int64)
        code = (tl.load(w_ptr + (c // 8) * total + r, mask=live, other=0) >> ((c % 8) * 4)) & 15
        zero = (
            (tl.load(z_ptr + g * (total // 8) + r // 8, mask=live, other=0) >> ((r % 8) * 4)) & 15
        ) + PARAM
        scale = tl.load(s_ptr + g * total + r, mask=live, other=0.0)
    elif FMT == 6:  # AWQ: qweight [in, out/8], output 8w + j in nibble (j // 2) + 4 (j % 2) of word w
        g = c // (width // groups)
        shift = ((r % 8) // 2 + (r % 2) * 4) * 4
        code = (tl.load(w_ptr + c * (total // 8) + r // 8, mask=live, other=0) >> shift) & 15
        zero = (tl.load(z_ptr + g * (total // 8) + r // 8, mask=live, other=0) >> shift) & 15
        scale = tl.load(s_ptr + g * total + r, mask=live, other=0.0)
    else:  # compressed-tensors: weight_packed [out, in/8], scale [out, G], zero points [out/8, G]; code + 8
        g = c // (width // groups)
        code = (tl.load(w_ptr + r * (width // 8) + c // 8, mask=live, other=0) >> ((c % 8) * 4)) & 15
        zero = tl.full((1, 1), 8, tl.int32)
        if FMT == 8:
            zero = (tl.load(z_ptr + (r // 8) * groups + g, mask=live, other=0) >> ((r % 8) * 4)) & 15
        scale = tl.load(s_ptr + r * groups + g, mask=live, other=0.0)
    return (code - zero).to(tl.float32) * scale.to(tl.float32)


@triton.jit
def _trellis_tile(w_ptr, s_ptr, rows, live, k0, row_bytes, CODE: tl.constexpr):
    """Trellis-coded weights [BLOCK, BK] fp32 (BK = one tile of 128 inputs) of rows [BLOCK, 1], times each
    row's scale: weight j of a tile is value j % 2 of the state of step j // 2, its L bits those of the
    tile's circular bit string ending at bit (j // 2 + 1)·B, most significant first. CODE: L · 256 + B."""
    L: tl.constexpr = CODE // 256
    B: tl.constexpr = CODE % 256
    TILE_BYTES: tl.constexpr = 8 * B  # 64 steps of B bits
    j = tl.arange(0, BK)[None, :]
    start = ((j // 2 + 1) * B - L + 64 * B) % (64 * B)  # the state's first bit
    base = w_ptr + rows * row_bytes + (k0 // 128) * TILE_BYTES
    word = tl.zeros(start.shape, tl.int64)
    for m in tl.static_range(4):  # 32 bits from the state's first byte on (L + 7 <= 31)
        byte = tl.load(base + (start // 8 + m) % TILE_BYTES, mask=live, other=0).to(tl.int64)
        word = word | (byte << (24 - 8 * m))
    state = (word >> (32 - start % 8 - L)) & ((1 << L) - 1)
    first = j % 2 == 0
    h = tl.where(first, state * MUL0 + ADD0, state * MUL1 + ADD1) & 0xFFFFFFFF
    total = (h & 255) + ((h >> 8) & 255) + ((h >> 16) & 255) + ((h >> 24) & 255)
    value = (total.to(tl.float32) - 510.0) / IRWIN_HALL_STD
    return value * tl.load(s_ptr + rows, mask=live, other=0.0).to(tl.float32)


@triton.jit
def weight_tile(
    w_ptr, s_ptr, z_ptr, a_ptr, out_rows, live_rows, k0, width, total, s_cols,
    FMT: tl.constexpr, PARAM: tl.constexpr,
):  # fmt: skip
    """w[out_rows, k0 : k0 + BK] → [BLOCK, BK] fp32, decoded in registers (fp8: times its block's scale;
    4-bit floats and int4: each code with its group's scale; NVFP4s' global scales not applied), 0 past
    `width` and in dead rows. The pointers are at the expert's matrix (`total` rows of `width`), scales,
    int4 zeros and GPTQ's g_idx row; `s_cols`: fp8's scale columns, int4's groups a row, trellis' code bytes
    a row; PARAM: `moe_dense_decode`'s `param`."""
    c = k0 + tl.arange(0, BK)
    live = live_rows[:, None] & (c < width)[None, :]
    rows = out_rows[:, None].to(tl.int64)
    if FMT == 9:
        return _trellis_tile(w_ptr, s_ptr, rows, live, k0, s_cols, PARAM)
    if FMT >= 5:
        return _int4_tile(
            w_ptr, s_ptr, z_ptr, a_ptr, rows, c[None, :], live, width, total, s_cols, FMT, PARAM
        )
    if FMT >= 2:
        return _fp4_tile(w_ptr, s_ptr, rows, live_rows, k0, width, FMT)
    w = tl.load(w_ptr + rows * width + c[None, :], mask=live, other=0.0).to(tl.float32)
    if FMT == 1:
        w *= tl.load(s_ptr + (out_rows // BK) * s_cols + k0 // BK, mask=live_rows, other=0.0)[:, None]
    return w


@triton.jit
def _rows_dot(
    w_ptr, s_ptr, z_ptr, a_ptr, out_rows, live_rows, v_ptr, k0, width, total, s_cols,
    FMT: tl.constexpr, PARAM: tl.constexpr,
):  # fmt: skip
    """Σ_j w[out_rows, k0 + j] · v[k0 + j] over one step of BK inputs → [BLOCK] fp32 (`weight_tile`'s;
    the 4-bit floats × 2⁻¹⁴, `_fp4_dot`'s); v_ptr: the vector's first entry, `width` of them."""
    if FMT >= 2 and FMT <= 4:
        rows = out_rows[:, None].to(tl.int64)
        return _fp4_dot(w_ptr, s_ptr, v_ptr, rows, live_rows, k0, width, FMT)
    c = k0 + tl.arange(0, BK)
    v = tl.load(v_ptr + c, mask=c < width, other=0.0).to(tl.float32)
    w = weight_tile(w_ptr, s_ptr, z_ptr, a_ptr, out_rows, live_rows, k0, width, total, s_cols, FMT, PARAM)
    return tl.sum(w * v[None, :], axis=1)


@triton.jit
def matrix_offsets(row, rows_out, width, s_rows, s_cols, FMT: tl.constexpr):
    """(weights, scales, int4 zeros) element offsets of pool row `row`'s matrix of `rows_out` × `width`."""
    if FMT == 9:  # s_cols: code bytes a row; a scale a row
        return row * rows_out * s_cols, row * rows_out, row
    if FMT >= 5:  # s_cols: groups a row; every int4 layout holds out·in/8 words, out·G scales, out·G/8 zeros
        return row * rows_out * (width // 8), row * rows_out * s_cols, row * (rows_out // 8) * s_cols
    if FMT >= 2:
        group: tl.constexpr = 32 if FMT == 3 else 16
        return row * rows_out * (width // 2), row * rows_out * (width // group), row
    return row * rows_out * width, row * s_rows * s_cols, row


@triton.jit
def global_scale(g_ptr, i, FMT: tl.constexpr):
    """A linear's global scale factor: NVFP4's `weight_scale_2`, compressed-tensors' 1 / global scale."""
    if FMT == 4:
        return 1.0 / tl.load(g_ptr + i)
    return tl.load(g_ptr + i)


@triton.jit
def dot_scale(g_ptr, i, FMT: tl.constexpr):
    """What `_rows_dot`'s sums of linear i are multiplied by: the NVFP4s' global scale, the 4-bit floats'
    2¹⁴, else 1."""
    if FMT == 2 or FMT == 4:
        return global_scale(g_ptr, i, FMT) * FP4_UNIT
    if FMT == 3:
        return FP4_UNIT
    return 1.0


@triton.jit
def _gate_up_kernel(
    x_ptr, rows_ptr, w_ptr, s_ptr, z_ptr, g_ptr, act_ptr, k, s_rows, s_cols,
    hidden: tl.constexpr, inter: tl.constexpr, FMT: tl.constexpr, PARAM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    p = tl.program_id(0)
    t = p // k
    row = tl.load(rows_ptr + p).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] act columns
    live = n < inter
    w_off, s_off, z_off = matrix_offsets(row, 2 * inter, hidden, s_rows, s_cols, FMT)
    w, s, z, a = w_ptr + w_off, s_ptr + s_off, z_ptr + z_off, g_ptr + row * 2 * hidden  # a: GPTQ's g_idx
    gate = tl.zeros((BLOCK,), dtype=tl.float32)
    up = tl.zeros((BLOCK,), dtype=tl.float32)
    xt = x_ptr + t * hidden
    for k0 in range(0, hidden, BK):
        gate += _rows_dot(w, s, z, a, n, live, xt, k0, hidden, 2 * inter, s_cols, FMT, PARAM)
        up += _rows_dot(w, s, z, a + hidden, n + inter, live, xt, k0, hidden, 2 * inter, s_cols, FMT, PARAM)
    gate *= dot_scale(g_ptr, 2 * row, FMT)  # gate's, up's
    up *= dot_scale(g_ptr, 2 * row + 1, FMT)
    if FMT == 9:  # trellis: the rotated outputs [P, 2I], turned back by the caller before the SiLU
        tl.store(act_ptr + p * 2 * inter + n, gate, mask=live)
        tl.store(act_ptr + p * 2 * inter + inter + n, up, mask=live)
    else:
        act = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) · up
        tl.store(act_ptr + p * inter + n, act, mask=live)


@triton.jit
def _down_kernel(
    act_ptr, rows_ptr, weights_ptr, w_ptr, s_ptr, z_ptr, g_ptr, out_ptr, s_rows, s_cols,
    hidden: tl.constexpr, inter: tl.constexpr, FMT: tl.constexpr, PARAM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    p = tl.program_id(0)
    row = tl.load(rows_ptr + p).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] output rows
    live = n < hidden
    w_off, s_off, z_off = matrix_offsets(row, hidden, inter, s_rows, s_cols, FMT)
    w, s, z, a = w_ptr + w_off, s_ptr + s_off, z_ptr + z_off, g_ptr + row * inter  # a: GPTQ's g_idx
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, inter, BK):
        acc += _rows_dot(w, s, z, a, n, live, act_ptr + p * inter, k0, inter, hidden, s_cols, FMT, PARAM)
    acc *= dot_scale(g_ptr, row, FMT)
    tl.store(out_ptr + p * hidden + n, acc * tl.load(weights_ptr + p).to(tl.float32), mask=live)


def dense_layout(pool: dict[str, torch.Tensor]) -> tuple[int, int, int]:
    """(FMT, hidden, inter) of a pool."""
    if "down_weight" in pool:  # [R, H, I/2]
        return NVFP4, pool["down_weight"].shape[1], 2 * pool["down_weight"].shape[2]
    if "down_blocks" in pool:  # [R, H, I/32, 16]
        return MXFP4, pool["down_blocks"].shape[1], 32 * pool["down_blocks"].shape[2]
    if "down_qweight" in pool:  # GPTQ [R, I/8, H], AWQ [R, I, H/8]; scales [R, G, H]
        fmt = GPTQ if "down_g_idx" in pool else AWQ
        return fmt, pool["down_scales"].shape[2], pool["gate_up_scales"].shape[2] // 2
    if "down_codes" in pool:  # trellis: scales [R, H] and [R, 2I]
        return TRELLIS, pool["down_scales"].shape[1], pool["gate_up_scales"].shape[1] // 2
    if "down_weight_packed" in pool:  # compressed-tensors [R, H, I/8] int32 or [R, H, I/2] uint8
        packed = pool["down_weight_packed"]
        if packed.dtype == torch.uint8:
            return CT_NVFP4, packed.shape[1], 2 * packed.shape[2]
        return (
            (CT_INT4_ZP if "down_weight_zero_point" in pool else CT_INT4),
            packed.shape[1],
            8 * packed.shape[2],
        )
    hidden, inter = pool["down"].shape[1:]
    return (FP8 if "gate_up_scale_inv" in pool else BF16), hidden, inter


_NAMES: dict[int, tuple[str, str, str | None, str | None]] = {
    NVFP4: ("weight", "weight_scale", None, "weight_scale_2"),
    MXFP4: ("blocks", "scales", None, None),
    CT_NVFP4: ("weight_packed", "weight_scale", None, "weight_global_scale"),
    GPTQ: ("qweight", "scales", "qzeros", "g_idx"),
    AWQ: ("qweight", "scales", "qzeros", None),
    CT_INT4: ("weight_packed", "weight_scale", None, None),
    CT_INT4_ZP: ("weight_packed", "weight_scale", "weight_zero_point", None),
    TRELLIS: ("codes", "scales", None, None),
}
"""A format's (weights, scales, int4 zeros, global scales or g_idx) component suffixes."""


Operands = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int]


def dense_operands(pool: dict[str, torch.Tensor], name: str, fmt: int) -> Operands:
    """(weights, scales, int4 zeros, global scales or g_idx, scale rows, scale columns) of matrix `name` as
    the kernels take them; a tensor a format lacks is stood in by the weights (never read: its branch is
    compiled out). Int4: scale columns are the groups a row."""
    if fmt in _NAMES:
        weights, scales, zeros, aux = _NAMES[fmt]
        w, s = pool[f"{name}_{weights}"], pool[f"{name}_{scales}"]
        s = s.view(torch.uint8) if s.dtype == torch.float8_e4m3fn else s
        cols = 1  # the kernels' s_cols: int4's groups a row, trellis' code bytes a row
        if fmt == TRELLIS:
            cols = w.shape[2]
        elif fmt >= GPTQ:
            cols = s.shape[1] if fmt in (GPTQ, AWQ) else s.shape[2]  # [R, G, out] or [R, out, G]
        z = pool[f"{name}_{zeros}"] if zeros else w
        return w, s, z, pool[f"{name}_{aux}"] if aux else w, 1, cols
    scale = pool.get(f"{name}_scale_inv")
    if scale is None:
        return pool[name], pool[name], pool[name], pool[name], 1, 1
    return pool[name], scale, pool[name], pool[name], scale.shape[1], scale.shape[2]


@dataclass(frozen=True)
class Mixing:
    """A trellis pool's incoherence (common/model/trellis_blocks.py): the codes are of H_out S_out W S_in
    H_in, so the kernels multiply inputs taken through `into` (v ↦ H S v on its last dim) and their outputs
    are taken back through `back` (v ↦ S H v); each knows its dim's signs."""

    into: Callable[[torch.Tensor], torch.Tensor]
    back: Callable[[torch.Tensor], torch.Tensor]


def moe_dense_decode(
    x: torch.Tensor,
    rows: torch.Tensor,
    weights: torch.Tensor,
    pool: dict[str, torch.Tensor],
    block: int = 16,
    before_down: Callable[[], None] | None = None,
    num_warps: int = 4,
    param: int = 0,
    mixing: Mixing | None = None,
) -> torch.Tensor:
    """Σ_j weights[t, j] · SwiGLU expert at pool row rows[t, j] (x[t]) → [T, H] in x's dtype.

    x [T, H] (contiguous); rows, weights [T, k]; pool: a bf16 pool (`gate_up` [R, 2I, H], `down` [R, H, I]),
    an fp8 one (the same in e4m3, with `gate_up_scale_inv` and `down_scale_inv`), or a 4-bit float, int4 or
    trellis one (their formats' components); `param`: the format's constant (GPTQ v1: 1, what a stored zero
    lacks; trellis: L · 256 + B) and `mixing` a trellis pool's. Any H and I the format takes. Fixed launch
    shapes, no host sync: a recorded step can hold it. `before_down` runs between the two kernels (to wait
    for the down rows' copies); `block` (output rows per program) and `num_warps` are tuning knobs.
    """
    t, k = rows.shape
    fmt, hidden, inter = dense_layout(pool)
    assert (fmt == TRELLIS) == (mixing is not None), "a trellis pool, and it alone, needs its mixing"
    pairs = t * k
    rows = rows.reshape(-1).contiguous()
    xin = x.contiguous() if mixing is None else mixing.into(x).contiguous()  # [T, H]
    act = torch.empty((pairs, inter * (2 if mixing else 1)), dtype=torch.float32, device=x.device)
    w, scale, zeros, aux, s_rows, s_cols = dense_operands(pool, "gate_up", fmt)
    launch = {
        "hidden": hidden,
        "inter": inter,
        "FMT": fmt,
        "PARAM": param,
        "BLOCK": block,
        "num_warps": num_warps,
    }
    _gate_up_kernel[(pairs, triton.cdiv(inter, block))](
        xin, rows, w, scale, zeros, aux, act, k, s_rows, s_cols, **launch
    )
    if mixing is not None:  # [P, 2I] rotated → SwiGLU → into the down linear's rotation
        gate, up = mixing.back(act).chunk(2, dim=-1)
        act = mixing.into(F.silu(gate) * up).contiguous()
    partial = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)
    if before_down is not None:
        before_down()
    w, scale, zeros, aux, s_rows, s_cols = dense_operands(pool, "down", fmt)
    _down_kernel[(pairs, triton.cdiv(hidden, block))](
        act, rows, weights.reshape(-1).contiguous(), w, scale, zeros, aux, partial, s_rows, s_cols, **launch
    )
    out = partial.view(t, k, hidden).sum(1)
    return (out if mixing is None else mixing.back(out)).to(x.dtype)
