"""Weights as llm-compressor's compressed-tensors stores them: `pack-quantized` int4 and
`nvfp4-pack-quantized`.

- pack-quantized, per linear: `weight_packed` int32 [out, in/8], element 8w+k in bits 4k..4k+3 of word w,
  each nibble the signed code q (−8..7) plus 8; `weight_scale` [out, in/group] in the model's dtype;
  asymmetric only, `weight_zero_point` int32 [ceil(out/8), in/group], the signed zero points packed the
  same way along the output dim (8 rows a word); `weight_shape` int64 [2] = [out, in]. w = (q − z) · s.
- nvfp4-pack-quantized, per linear: `weight_packed` uint8 [out, in/2] (e2m1 codes, `fp4_blocks`' nibble
  order), `weight_scale` e4m3 [out, in/16], `weight_global_scale` fp32 [1] (the reciprocal of ModelOpt's
  weight_scale_2: 448 · 6 / amax) and, with static activation scales, `input_global_scale` fp32 [1].
  w = e2m1 · (s / global) in fp32, the quotient rounded first, as compressed-tensors dequantises.
"""

from __future__ import annotations

import torch

from common.model.fp4_blocks import E2M1_MAX, E4M3_MAX, NVFP4_GROUP, e2m1_decode, pack_nibbles, unpack_nibbles

INT4_OFFSET = 8  # a stored nibble is the signed code plus 8
INT4_MIN, INT4_MAX = -8, 7
PER_WORD = 8  # int4 codes per int32


def pack_int32(codes: torch.Tensor) -> torch.Tensor:
    """Signed int4 codes [..., n] (n % 8 == 0) -> int32 [..., n/8] as compressed-tensors packs them."""
    nibbles = (codes.to(torch.int16) + INT4_OFFSET).to(torch.uint8)
    packed = pack_nibbles(nibbles)  # [..., n/2]
    # through a flat copy: a view of bytes as int32 needs strides a size-1 dim may not have
    return packed.reshape(-1).view(torch.int32).reshape(*packed.shape[:-1], -1)


def unpack_int32(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., n/8] -> signed int4 codes int8 [..., n]; the inverse of `pack_int32`."""
    flat = packed.reshape(-1).view(torch.uint8).reshape(*packed.shape[:-1], -1)  # [..., n/2]
    return unpack_nibbles(flat).to(torch.int8) - INT4_OFFSET


def pack_int32_rows(codes: torch.Tensor) -> torch.Tensor:
    """Signed codes [..., out, G] (out % 8 == 0) -> int32 [..., out/8, G]: packed along the output dim, as
    compressed-tensors packs zero points."""
    packed = pack_int32(codes.transpose(-1, -2)).transpose(-1, -2)
    return packed.reshape(-1).reshape(packed.shape)  # row-major strides (a size-1 dim's included)


def unpack_int32_rows(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """int32 [..., ceil(out/8), G] -> signed codes int8 [..., rows, G]; the inverse of `pack_int32_rows`."""
    return unpack_int32(packed.transpose(-1, -2))[..., :rows].transpose(-1, -2)


def quantize_w4a16(
    weight: torch.Tensor, group: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """weight [out, in] -> (weight_packed int32 [out, in/8], weight_scale [out, in/group] in the weight's
    dtype, weight_zero_point int32 [out/8, in/group] or None when symmetric), as llm-compressor's
    round-to-nearest (min-max observer) computes them: every step in the weight's dtype, its ranges widened
    to include 0, symmetric scale amax / 7.5, asymmetric (max − min) / 15 and zero point −8 − min / scale."""
    out, inp = weight.shape
    if inp % group:
        raise ValueError(f"the input dim {inp} is not a multiple of the group size {group}")
    w = weight.reshape(out, inp // group, group)  # [out, G, group]
    lo = torch.minimum(w.amin(dim=-1), torch.zeros((), dtype=w.dtype))  # [out, G]
    hi = torch.maximum(w.amax(dim=-1), torch.zeros((), dtype=w.dtype))
    if symmetric:
        scale = torch.maximum(lo.abs(), hi) / torch.tensor(7.5, dtype=w.dtype)
        zero = torch.zeros_like(scale)
    else:
        scale = (hi - lo) / torch.tensor(15.0, dtype=w.dtype)
        zero = (torch.tensor(INT4_MIN, dtype=w.dtype) - lo / scale).clamp(INT4_MIN, INT4_MAX)
    scale = torch.where(scale == 0, torch.finfo(w.dtype).eps, scale)  # compressed-tensors' guard
    zero = torch.round(zero.clamp(-128, 127))  # rounded as int8
    scaled = w / scale[..., None]
    if not symmetric:
        scaled = scaled + zero[..., None]
    codes = torch.round(scaled.clamp(INT4_MIN, INT4_MAX)).to(torch.int8).reshape(out, inp)
    zero_point = None if symmetric else pack_int32_rows(zero.to(torch.int8))
    return pack_int32(codes), scale.contiguous(), zero_point


def dequantize_w4a16(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """(weight_packed int32 [..., out, in/8], weight_scale [..., out, G], weight_zero_point int32
    [..., out/8, G] or None) -> (q − z) · s [..., out, in] in dtype, formed in fp32 (exact: a 5-bit integer
    times a 16-bit float) and rounded once."""
    codes = unpack_int32(packed)  # [..., out, in]
    out, inp = codes.shape[-2:]
    groups = scale.shape[-1]
    q = codes.reshape(*codes.shape[:-1], groups, inp // groups).float()  # [..., out, G, group]
    if zero_point is not None:
        q = q - unpack_int32_rows(zero_point, out).float()[..., None]
    return (q * scale.float()[..., None]).reshape(codes.shape).to(dtype)


# --- NVFP4 ------------------------------------------------------------------------------------------------


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 values (within ±6) -> e2m1 codes (uint8) as compressed-tensors rounds them: to nearest, a tie
    to the even mantissa (0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4); the sign bit set where x < 0 (−0.1 -> code
    8, −0 -> 0)."""
    mag = x.abs()
    steps = (mag > 0.25, mag >= 0.75, mag > 1.25, mag >= 1.75, mag > 2.5, mag >= 3.5, mag > 5.0)
    code = torch.stack(steps).sum(dim=0).to(torch.uint8)  # how many code boundaries mag is past
    return code | ((x < 0).to(torch.uint8) << 3)


def ct_nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """The global scale of weights whose absolute max is `amax` (a 0-d tensor in the weights' dtype):
    448 · 6 / amax computed in that dtype, as compressed-tensors does, then fp32 [1]."""
    top = amax.clamp(min=torch.finfo(amax.dtype).tiny)
    scale = torch.nan_to_num(E4M3_MAX * E2M1_MAX / top, nan=1.0, posinf=1.0, neginf=1.0)
    return scale.to(torch.float32).reshape(1)


def quantize_ct_nvfp4(
    weight: torch.Tensor, global_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (weight_packed uint8 [out, in/2], weight_scale e4m3 [out, in/16],
    weight_global_scale fp32 [1]) as compressed-tensors computes them: the global scale its own
    (`ct_nvfp4_global_scale`) unless given (llm-compressor gives gate and up one, of both), block scale e4m3
    of global · (amax / 6), codes of w / (scale / global)."""
    out, inp = weight.shape
    if global_scale is None:
        global_scale = ct_nvfp4_global_scale(weight.abs().amax())
    blocks = weight.reshape(out, inp // NVFP4_GROUP, NVFP4_GROUP)
    zero = torch.zeros((), dtype=weight.dtype)
    amax = torch.maximum(-torch.minimum(blocks.amin(dim=-1), zero), torch.maximum(blocks.amax(dim=-1), zero))
    local = global_scale * (amax / torch.tensor(E2M1_MAX, dtype=amax.dtype))  # [out, G] fp32
    scale = local.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    scale = torch.where(scale == 0, torch.tensor(0.125), scale)  # compressed-tensors' guard (e4m3's eps)
    step = scale / global_scale  # [out, G]
    codes = e2m1_round((blocks / step[..., None]).clamp(-E2M1_MAX, E2M1_MAX))
    return pack_nibbles(codes.reshape(out, inp)), scale.to(torch.float8_e4m3fn), global_scale


def dequantize_ct_nvfp4(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """(weight_packed uint8 [..., out, in/2], weight_scale e4m3 [..., out, in/16], weight_global_scale fp32
    [..., 1] or one per row [..., out]) -> e2m1 · (s / global) [..., out, in] in dtype: the quotient and the
    product each rounded in fp32, as compressed-tensors computes them, then rounded once to dtype."""
    values = e2m1_decode(unpack_nibbles(packed))  # [..., out, in]
    step = scale.float() / global_scale.float()[..., None]  # [..., out, G]
    blocks = values.reshape(*scale.shape, NVFP4_GROUP) * step[..., None]
    return blocks.reshape(values.shape).to(dtype)
