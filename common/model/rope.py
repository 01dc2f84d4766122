"""Rotary position embedding: inverse frequencies per scaling type, applied to [T, heads, D] tensors."""

from __future__ import annotations

import math

import torch

from common.config import RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rot_dim / 2] (fp32) and the scale applied to cos/sin, as HF computes them."""
    dim = int(head_dim * rope.partial_rotary_factor)
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    original = rope.original_max_position or max_position
    if rope.rope_type == "yarn":
        return _yarn(rope, dim, original)
    if rope.rope_type == "llama3":
        return _llama3(rope, inv_freq, original), 1.0
    raise ValueError(f"rope type {rope.rope_type!r} is not supported")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, dim: int, original: int) -> tuple[torch.Tensor, float]:
    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1 where a dimension keeps its original frequency
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def _llama3(rope: RopeConfig, inv_freq: torch.Tensor, original: int) -> torch.Tensor:
    low_wavelen = original / rope.low_freq_factor
    high_wavelen = original / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (original / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Rotates the first `rot_dim` channels of each head by position (the HF "rotate half" layout)."""

    inv_freq: torch.Tensor  # [rot_dim/2] a registered buffer

    def __init__(self, rope: RopeConfig, head_dim: int, max_position: int) -> None:
        super().__init__()
        self.rope, self.head_dim, self.max_position = rope, head_dim, max_position
        inv_freq, self.scaling = rope_inv_freq(rope, head_dim, max_position)
        self.rot_dim = inv_freq.numel() * 2
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def init_buffers(self) -> None:
        """Recompute inv_freq in place (after a model built on the meta device is materialised)."""
        inv_freq, _ = rope_inv_freq(self.rope, self.head_dim, self.max_position)
        self.inv_freq = inv_freq.to(self.inv_freq.device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, rot_dim] for positions [T], or [3, T] (temporal, height, width: multimodal RoPE,
        `RopeConfig.mrope_section`), in `dtype` (HF casts them to the activation dtype)."""
        if positions.dim() == 2:
            freqs = self._mrope_freqs(positions)
        else:
            freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, rot_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)

    def _mrope_freqs(self, positions: torch.Tensor) -> torch.Tensor:
        """Angles [T, rot_dim/2] for positions [3, T]: each frequency takes its axis's position (interleaved
        sections, as transformers' qwen4_exp recomposes them)."""
        section = self.rope.mrope_section
        if not section:
            raise ValueError("positions [3, T] need a multimodal rotary (rope_parameters.mrope_section)")
        i = torch.arange(self.inv_freq.numel(), device=positions.device)
        axis = torch.zeros_like(i)
        for a in (1, 2):
            axis[(i % 3 == a) & (i < 3 * section[a])] = a
        chosen = positions.gather(0, axis[:, None].expand(-1, positions.shape[1]))  # [rot_dim/2, T]
        return chosen.t().float() * self.inv_freq[None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated on its first cos.shape[-1] channels; cos/sin [T, rot_dim]."""
    rot_dim = cos.shape[-1]
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    half = rot_dim // 2
    rotated_half = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos[:, None, :] + rotated_half * sin[:, None, :]
    return out if rest.numel() == 0 else torch.cat((out, rest), dim=-1)
