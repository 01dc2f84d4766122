"""4-bit float weights as checkpoints publish them: NVFP4 (NVIDIA ModelOpt) and MXFP4 (OCP MX, as gpt-oss
releases it); read by the loader and the expert formats, written by the synthetic checkpoints.

Both store e2m1 codes, two a byte: element 2j in byte j's low nibble, 2j+1 in its high one; code bits
s·e1e0·m, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (`E2M1_VALUES`).

- NVFP4, per linear: `weight` uint8 [out, in/2], `weight_scale` float8_e4m3fn [out, in/16] (one per 16
  inputs) and `weight_scale_2` fp32 (one per tensor): w = (e2m1 · weight_scale) · weight_scale_2 in fp32.
- MXFP4: `blocks` uint8 [out, in/32, 16] and `scales` uint8 e8m0 [out, in/32]: w = e2m1 · 2^(scale − 127).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [..., in] (in even) -> uint8 [..., in/2]: column 2j in the low nibble of byte j,
    column 2j+1 in its high nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"nibble packing needs an even last dim, got {tuple(codes.shape)}")
    codes = codes.to(torch.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., in/2] -> uint8 codes 0..15 [..., in]; the inverse of `pack_nibbles`."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)  # [..., in/2, 2] -> [..., in]


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The value of each 4-bit e2m1 code."""
E2M1_MAX = 6.0
E4M3_MAX = 448.0
NVFP4_GROUP = 16
MXFP4_GROUP = 32
E8M0_BIAS = 127

_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between consecutive e2m1 magnitudes


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [...] -> their fp32 values [...], from the code's bits (no table: nothing is copied
    from the host, so a captured CUDA graph may run it)."""
    c = codes.to(torch.int32)
    exponent, mantissa = (c >> 1) & 3, (c & 1).float()
    normal = torch.ldexp(1 + mantissa / 2, (exponent - 1).float())  # 2^(e−1) · 1.m
    magnitude = torch.where(exponent == 0, mantissa / 2, normal)
    return torch.where(c >= 8, -magnitude, magnitude)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 values [...] -> the nearest e2m1 codes (uint8 [...]); magnitudes over 6 saturate to 6, a tie goes
    to the smaller magnitude."""
    bounds = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=x.device)
    magnitude = torch.bucketize(x.abs().clamp(max=E2M1_MAX), bounds).to(torch.uint8)  # 0..7
    return magnitude | ((x < 0).to(torch.uint8) << 3)


def _grouped(w: torch.Tensor, group: int) -> torch.Tensor:
    """[..., out, in] -> [..., out, in/group, group] (fp32); ValueError if in is no multiple of group."""
    if w.shape[-1] % group:
        raise ValueError(f"the input dim {w.shape[-1]} is not a multiple of {group}")
    return w.float().reshape(*w.shape[:-1], w.shape[-1] // group, group)


# --- NVFP4 --------------------------------------------------------------------------------------------------


def quantize_nvfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (weight uint8 [out, in/2], weight_scale e4m3 [out, in/16], weight_scale_2 fp32 [])
    as ModelOpt exports it: global scale amax / (6 · 448), block scale (block amax / 6) / global in e4m3,
    codes of w / (block · global)."""
    blocks = _grouped(weight, NVFP4_GROUP)  # [out, G, 16]
    top = float(weight.float().abs().max())
    scale_2 = torch.tensor(top / (E2M1_MAX * E4M3_MAX) if top > 0 else 1.0, dtype=torch.float32)
    block_amax = blocks.abs().amax(dim=-1)  # [out, G]
    scale = (block_amax / E2M1_MAX / scale_2).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    step = (scale.float() * scale_2)[..., None]  # [out, G, 1]
    codes = e2m1_encode(torch.where(step > 0, blocks / step, torch.zeros_like(blocks)))
    return pack_nibbles(codes.reshape(weight.shape)), scale.contiguous(), scale_2


def dequantize_nvfp4(
    weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """(weight uint8 [..., out, in/2], weight_scale e4m3 [..., out, in/16], weight_scale_2 fp32 [..., out])
    -> (e2m1 · weight_scale) · weight_scale_2 [..., out, in], formed in fp32 (the first product exact) and
    rounded once to dtype."""
    values = e2m1_decode(unpack_nibbles(weight))  # [..., out, in]
    blocks = values.reshape(*weight_scale.shape, NVFP4_GROUP) * weight_scale.float()[..., None]
    return (blocks * weight_scale_2.float()[..., None, None]).reshape(values.shape).to(dtype)


# --- MXFP4 --------------------------------------------------------------------------------------------------


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., out, in] -> (blocks uint8 [..., out, in/32, 16], scales uint8 e8m0 [..., out, in/32]):
    each block's scale 2^(floor(log2 amax) − 2) (its largest value lands in [4, 8), saturating at 6),
    codes of w / scale."""
    blocks = _grouped(weight, MXFP4_GROUP)  # [..., out, G, 32]
    amax = blocks.abs().amax(dim=-1)  # [..., out, G]
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -E8M0_BIAS))
    exponent = exponent.clamp(-E8M0_BIAS, E8M0_BIAS).to(torch.int32)
    codes = e2m1_encode(torch.ldexp(blocks, -exponent[..., None].float()))
    packed = pack_nibbles(codes)  # [..., out, G, 16]
    return packed.contiguous(), (exponent + E8M0_BIAS).to(torch.uint8).contiguous()


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(blocks uint8 [..., out, in/32, 16], scales uint8 [..., out, in/32]) -> e2m1 · 2^(scale − 127)
    [..., out, in] in dtype (exact in fp32 up to its range)."""
    values = e2m1_decode(unpack_nibbles(blocks))  # [..., out, G, 32]
    exponent = scales.to(torch.int32) - E8M0_BIAS
    w = values * torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent.float())[..., None]
    return w.reshape(*w.shape[:-2], -1).to(dtype)


def dequantize_nvfp4_experts(
    parts: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """N experts' NVFP4 components ({gate_up,down}_{weight,weight_scale,weight_scale_2}, leading dim N) ->
    (gate_up [N, 2I, H], down [N, H, I]) in dtype; gate_up's rows take gate's, then up's global scale."""
    out = []
    for key in ("gate_up", "down"):
        weight, scale_2 = parts[f"{key}_weight"], parts[f"{key}_weight_scale_2"]  # [N, out, in/2], [N, t]
        rows = scale_2.repeat_interleave(weight.shape[-2] // scale_2.shape[-1], dim=-1)  # [N, out]
        out.append(dequantize_nvfp4(weight, parts[f"{key}_weight_scale"], rows, dtype))
    return out[0], out[1]


def dequantize_mxfp4_experts(
    parts: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """N experts' MXFP4 components ({gate_up,down}_{blocks,scales}, leading dim N) -> (gate_up [N, 2I, H],
    down [N, H, I]) in dtype."""
    gate_up = dequantize_mxfp4(parts["gate_up_blocks"], parts["gate_up_scales"], dtype)
    return gate_up, dequantize_mxfp4(parts["down_blocks"], parts["down_scales"], dtype)


DEQUANTIZE_EXPERTS = {"nvfp4": dequantize_nvfp4_experts, "mxfp4": dequantize_mxfp4_experts}
"""Published expert format -> its experts' dequantiser (what the loader and the expert formats share)."""
