"""Resident linear layers in fp8 (`--resident-dtype fp8`): e4m3 codes with one fp32 scale per output row and
block of 128 inputs.

What it is for: the token mixers' projections are ~55 % of flashnext's resident bytes (5 GiB in bf16); in
fp8 they leave ~2.5 GiB more to the expert cache under the same budget, and a decode step reads half the
bytes for them. The scales are per row and 128-input block (1×128) rather than per 128×128 tile: the fused
projections concatenate matrices whose row counts are not multiples of 128 (Gated DeltaNet's b and a: 48
rows), and a per-row scale lets each member of a fused weight keep its own scales as a row view of the
fused ones; they cost 1/32 of the codes' bytes.

Which: each token mixer's input projections (fused or not) and its output projection (Gated DeltaNet,
QSA). The router (its choices), the embeddings, lm_head, norms and hyper-connections stay in the model dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from common.kernels import GEMV_ROWS
from common.kernels.config import KERNELS, KernelConfig
from common.model.fused_linear import FusedLinears

if TYPE_CHECKING:
    from common.model.qwen4_exp.gdn import GatedDeltaNet
    from common.model.qwen4_exp.qsa import QSAttention

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
BLOCK_K = 128
"""Inputs per scale (the quantisation block along K)."""


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] → (codes [N, K] e4m3, scales [N, ⌈K/128⌉] fp32): weight ≈ codes · scale per row and block
    of 128 inputs (each block's largest magnitude maps to 448). Shapes only on the meta device."""
    n, k = weight.shape
    blocks = -(-k // BLOCK_K)
    padded = F.pad(weight.float(), (0, blocks * BLOCK_K - k)).view(n, blocks, BLOCK_K)
    scale = padded.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX  # [N, blocks]
    codes = (padded / scale[..., None]).view(n, -1)[:, :k].to(FP8)
    return codes.contiguous(), scale.contiguous()


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [N, K] e4m3, scale [N, ⌈K/128⌉] → [N, K] in `dtype`, each product in fp32 as the kernel forms it
    (one fp32 [N, K] temporary, scaled in place: prefill dequantises one weight at a time)."""
    n, k = codes.shape
    blocks = scale.shape[1]
    padded = F.pad(codes.float(), (0, blocks * BLOCK_K - k)) if k % BLOCK_K else codes.float()
    padded.view(n, blocks, BLOCK_K).mul_(scale[..., None])
    return padded[:, :k].to(dtype)


def largest_dequantized(model: nn.Module) -> int:
    """Elements of the largest weight a pass may dequantise at once: a token mixer's input projections
    together (fused) or its output projection, over the model's fp8 mixers (0: none)."""
    largest = 0
    for mixer, output in _mixers(model):
        out = getattr(mixer, output)
        if isinstance(out, Fp8Linear):
            inputs = sum(m.out_features * m.in_features for m in mixer._inputs())
            largest = max(largest, inputs, out.out_features * out.in_features)
    return largest


def fp8_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    kernels: KernelConfig = KERNELS,
) -> torch.Tensor:
    """x [..., K] through the fp8 weight: a few rows on CUDA by the GEMV kernel (common/kernels/gemv.py: the
    codes read once), else the weight dequantised for one GEMM (prefill: the GEMM's time dwarfs it)."""
    rows = x.numel() // x.shape[-1]
    if x.is_cuda and 0 < rows <= GEMV_ROWS:
        from common.kernels.gemv import gemv  # Triton

        y = gemv(x.reshape(rows, -1), codes, bias, scale, kernels=kernels)
        return y.view(*x.shape[:-1], -1)
    return F.linear(x, dequantize_fp8(codes, scale, x.dtype), bias)


class Fp8Linear(nn.Module):
    """A Linear whose weight is fp8 codes (`qweight`) and per-row, per-128-input scales (`scale`): buffers,
    so the memory plan and `.to()` see them; possibly row views of a fused projection's."""

    qweight: torch.Tensor
    """[N, K] e4m3 codes."""
    scale: torch.Tensor
    """[N, ⌈K/128⌉] fp32 scales."""
    kernels: KernelConfig = KERNELS
    """The kernel forms and launch options (set where the worker builds the model: `configure_kernels`)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("qweight", codes)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.qweight, self.scale, self.bias, self.kernels)

    @staticmethod
    def fuse_group(linears: Sequence[Fp8Linear]) -> Fp8Fused | None:
        """`fuse_linears` for a group of fp8 Linears: `fuse_fp8`."""
        return fuse_fp8(linears)


class Fp8Fused(FusedLinears):
    """A fused projection (fused_linear.py) whose concatenated weight is fp8."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]):
        super().__init__(codes, bias, sizes)
        self.scale = scale

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return fp8_linear(x, self.weight, self.scale, self.bias, self.kernels).split(self.sizes, dim=-1)


def fuse_fp8(linears: Sequence[Fp8Linear]) -> Fp8Fused | None:
    """`fuse_linears` for fp8 members: one Fp8Fused over their codes and scales where those already lie back
    to back (rows of one quantised fused weight, in this process or mapped from another), else None."""
    from common.model.fused_linear import _adjacent

    codes = _adjacent([m.qweight for m in linears])
    scale = _adjacent([m.scale for m in linears])
    biases = [m.bias for m in linears]
    present = [b for b in biases if b is not None]
    if codes is None or scale is None or len({b is None for b in biases}) != 1:
        return None
    bias = None if biases[0] is None else _adjacent(present)  # all or none present
    if biases[0] is not None and bias is None:
        return None
    return Fp8Fused(codes, scale, bias, [m.out_features for m in linears])


def _to_fp8(linear: nn.Linear) -> Fp8Linear:
    codes, scale = quantize_fp8(linear.weight.detach())
    return Fp8Linear(codes, scale, None if linear.bias is None else linear.bias.detach())


def _quantize_mixer(
    mixer: GatedDeltaNet | QSAttention, output: str, parents: dict[int, tuple[nn.Module, str]]
) -> None:
    """`mixer`'s input projections (fused or one by one) and its output projection `output` to fp8."""
    inputs = mixer._inputs()
    fused = mixer.fused_in
    if fused is not None:  # one quantisation of the fused weight; each member a row view of it
        n = sum(fused.sizes)  # the Linears' rows, not the fused weight's alignment padding
        codes, scale = quantize_fp8(fused.weight[:n].detach())
        bias = None if fused.bias is None else fused.bias[:n].detach()
        mixer.fused_in = Fp8Fused(codes, scale, bias, fused.sizes)
        at = 0
        for linear, size in zip(inputs, fused.sizes, strict=True):
            rows = slice(at, at + size)
            member = Fp8Linear(codes[rows], scale[rows], None if bias is None else bias[rows])
            parent, name = parents[id(linear)]
            setattr(parent, name, member)
            at += size
    else:
        for linear in inputs:
            parent, name = parents[id(linear)]
            setattr(parent, name, _to_fp8(linear))
    setattr(mixer, output, _to_fp8(getattr(mixer, output)))


def quantize_resident(model: nn.Module) -> int:
    """Turn the token mixers' projections of `model` to fp8 (after loading and fusing) → how many mixers.
    On the meta device (the memory plan) only shapes change. The model-dtype weights they replace are
    freed as they go (call `torch.cuda.empty_cache()` after, to return their blocks)."""
    parents = {
        id(child): (parent, name) for parent in model.modules() for name, child in parent.named_children()
    }
    mixers = _mixers(model)
    with torch.no_grad():
        for mixer, output in mixers:
            _quantize_mixer(mixer, output, parents)
    return len(mixers)


def _mixers(model: nn.Module) -> list[tuple[GatedDeltaNet | QSAttention, str]]:
    """The token mixers fp8 covers (those whose class names its output projection: `fp8_output`), each with
    its output projection's name."""
    mixers = [m for m in model.modules() if "fp8_output" in vars(type(m))]
    return [(cast("GatedDeltaNet | QSAttention", m), vars(type(m))["fp8_output"]) for m in mixers]


RESIDENT_DTYPES = ("fp8",)
"""`--resident-dtype` choices besides the model dtype."""


def to_resident_dtype(model: nn.Module, name: str) -> None:
    """`--resident-dtype NAME` for a loaded model (before the expert cache takes the memory it frees)."""
    if name not in RESIDENT_DTYPES:
        raise ValueError(f"--resident-dtype must be one of {RESIDENT_DTYPES}, not {name!r}")
    if quantize_resident(model) == 0:
        raise ValueError("--resident-dtype fp8 covers qwen4_exp's token mixers; this model has none")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the model-dtype weights' blocks
