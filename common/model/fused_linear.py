"""Linears that read the same input, run as one GEMM.

A decode step multiplies one token by each weight matrix: a GEMV that cuBLAS runs in a few microseconds,
however small the matrix. Per layer of qwen4_exp, the token mixer's input projections (4 for Gated DeltaNet,
4 for QSA with its indexer), the MoE block's router, shared expert gate/up and shared-expert gate, and each
hyper-connection's mix-down and inject weights all read one input: concatenated, they are a few launches
instead of ~16, each reading the same bytes.

The checkpoint's modules stay as they are: `fuse_linears` makes each Linear's weight a view of its rows in one
[ΣN, K] tensor, so state dicts, parameter sharing across processes and the memory plan see the same
parameters, and no byte is held twice.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from common.kernels import GEMV_ROWS
from common.kernels.config import KERNELS, KernelConfig

ALIGN_BYTES = 16
"""A fused weight gets rows beyond its Linears' (never read back) up to an output row of a multiple of this:
cuBLAS's fast Hopper GEMMs want 16-byte-aligned rows; unaligned widths fall to slow low-alignment kernels."""


def _padding(rows: int, itemsize: int) -> int:
    """Rows to add to `rows` output columns of `itemsize` bytes for ALIGN_BYTES-aligned output rows."""
    step = max(1, ALIGN_BYTES // itemsize)
    return -rows % step


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, kernels: KernelConfig = KERNELS
) -> torch.Tensor:
    """x [..., K] · weightᵀ (+ bias): with KernelConfig.gemv, one bf16 row times a weight of a few thousand
    rows through the CUDA C GEMV (common/kernels/gemv_native.py: `takes`), a few rows on CUDA through the
    Triton GEMV where it beats cuBLAS (common/kernels/gemv.py: `choose`); else F.linear."""
    rows = x.numel() // x.shape[-1]
    if (
        kernels.gemv
        and x.is_cuda
        and 0 < rows <= GEMV_ROWS
        and weight.dtype == x.dtype
        and weight.is_contiguous()
    ):
        from common.kernels import gemv_native
        from common.kernels.gemv import choose, gemv  # Triton

        flat = x.reshape(rows, -1)
        if gemv_native.takes(flat, weight, bias, kernels):
            return gemv_native.gemv_row(flat, weight, bias, kernels).view(*x.shape[:-1], -1)
        config = choose(rows, weight.shape[0], weight.shape[1], x.device, kernels=kernels)
        if config is not None:
            return gemv(flat, weight, bias, config=config, kernels=kernels).view(*x.shape[:-1], -1)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose few-row products on CUDA run through the Triton GEMV (`linear`): a decode step's
    output projections. Same parameters and state dict keys as nn.Linear."""

    kernels: KernelConfig = KERNELS
    """The kernel forms and launch options (set where the worker builds the model: `configure_kernels`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.kernels)


class FusedLinears:
    """The concatenated weight (and bias) of some Linears, and how to split its output."""

    kernels: KernelConfig = KERNELS
    """The kernel forms and launch options (set where the worker builds the model: `configure_kernels`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]) -> None:
        """weight [ΣN + pad, K]: the Linears' rows (`sizes`), then `pad` rows whose outputs are dropped."""
        self.weight, self.bias, self.sizes = weight, bias, sizes
        self.pad = weight.shape[0] - sum(sizes)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, K] → one [T, N_i] output per Linear, in order (views of one [T, ΣN + pad] product)."""
        return self.split(linear(x, self.weight, self.bias, self.kernels))

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The fused weight's product [T, ΣN + pad] (however computed) → one [T, N_i] view per Linear."""
        return out.split([*self.sizes, self.pad], dim=-1)[:-1]


def project(
    x: torch.Tensor, linears: Sequence[nn.Linear], fused: FusedLinears | None
) -> tuple[torch.Tensor, ...]:
    """Each Linear of `linears` applied to x: one GEMM through `fused` when it is there."""
    if fused is not None:
        return fused(x)
    return tuple(linear(x) for linear in linears)


def plain_linear(linear: nn.Module | FusedLinears | None) -> bool:
    """A bias-free Linear (or fused Linears) with a contiguous weight, not an fp8 one: what the Triton GEMVs
    that fold a projection into their neighbours read (common/kernels/hyper.py, gated_mlp.py)."""
    kind = type(linear) in (nn.Linear, Linear, FusedLinears)
    plain = cast("nn.Linear | FusedLinears", linear)  # (read only when `kind`)
    return kind and plain.bias is None and plain.weight.is_contiguous()


def takes_conv(x: torch.Tensor, fused: object, kernels: KernelConfig = KERNELS) -> bool:
    """Whether `gemv` with a ConvStep computes x [1, K] through `fused`: KernelConfig.conv_epilogue and
    .gemv, x on CUDA, `fused`
    bf16 FusedLinears (no bias, contiguous) of x's dtype whose product the GEMV takes (GEMV: GDN's
     input projection in a one-token step)."""
    return (
        kernels.conv_epilogue
        and kernels.gemv
        and isinstance(fused, FusedLinears)
        and plain_linear(fused)
        and x.is_cuda
        and x.shape[0] == 1
        and fused.weight.dtype == x.dtype
    )


def fuse_linears(linears: Sequence[nn.Linear], copy: bool = True) -> FusedLinears | None:
    """Concatenate the weights of `linears` (one input width, dtype and device; all with a bias or none):
    each Linear's weight becomes a view of its rows. Weights that already are consecutive rows of one storage
    (a process that maps another's fused weights) are viewed as they are; otherwise, with `copy`, they are
    copied into a new tensor (and their old memory freed), and without it nothing is fused (None)."""
    if all(hasattr(linear, "qweight") for linear in linears):  # fp8 (fp8_linear.py): views of one weight only
        fuse_group = cast(Callable[[Sequence[nn.Module]], FusedLinears | None], linears[0].fuse_group)
        return fuse_group(linears)
    if not all(isinstance(linear, nn.Linear) for linear in linears):
        return None
    weights = [linear.weight for linear in linears]
    biases = [linear.bias for linear in linears]
    first = weights[0]
    if len({(w.shape[1], w.dtype, w.device) for w in weights}) != 1 or len({b is None for b in biases}) != 1:
        return None
    if biases[0] is not None and len({b.dtype for b in biases}) != 1:
        return None
    sizes = [w.shape[0] for w in weights]
    pad = _padding(sum(sizes), first.element_size())
    weight = _adjacent(weights, pad)
    bias = None if biases[0] is None else _adjacent(biases, pad)
    if weight is not None and bias is not None and bias.shape[0] != weight.shape[0]:
        weight, bias = _adjacent(weights), _adjacent(biases)  # one mapped with its padding, one not
    if weight is None or (biases[0] is not None and bias is None):
        if not copy:
            return None
        with torch.no_grad():
            extra = first.new_zeros((pad, *first.shape[1:]))
            weight = torch.cat([*(w.detach() for w in weights), extra])  # [ΣN + pad, K]
            if biases[0] is not None:
                bias = torch.cat([*(b.detach() for b in biases), biases[0].new_zeros(pad)])
        rows = weight.split([*sizes, pad])
        for linear, w in zip(linears, rows, strict=False):
            linear.weight = nn.Parameter(w, requires_grad=first.requires_grad)
        if bias is not None:
            for linear, b in zip(linears, bias.split([*sizes, pad]), strict=False):
                linear.bias = nn.Parameter(b, requires_grad=first.requires_grad)
    return FusedLinears(weight, bias, sizes)


def _adjacent(parts: Sequence[torch.Tensor], pad: int = 0) -> torch.Tensor | None:
    """The tensor of `parts` concatenated on dim 0 when they already lie back to back in one storage
    (contiguous, each starting where the previous one ends), as a view, with the `pad` rows after them when
    the storage holds them (a weight fused with its padding, mapped from another process); else None."""
    first = parts[0]
    base = first.untyped_storage().data_ptr()
    if first.device.type == "meta" or not all(
        p.is_contiguous() and p.untyped_storage().data_ptr() == base for p in parts
    ):
        return None
    for a, b in itertools.pairwise(parts):
        if a.data_ptr() + a.numel() * a.element_size() != b.data_ptr():
            return None
    rows = sum(p.shape[0] for p in parts)
    row_bytes = math.prod(first.shape[1:]) * first.element_size()
    start, held = first.storage_offset() * first.element_size(), first.untyped_storage().nbytes()
    if start + rows * row_bytes > held:
        return None
    if start + (rows + pad) * row_bytes <= held:
        rows += pad
    shape = (rows, *first.shape[1:])
    stride = torch.empty(shape, device="meta").stride()  # contiguous (a 1-row part may carry any stride)
    view = torch.empty(0, dtype=first.dtype, device=first.device)
    view.set_(first.untyped_storage(), first.storage_offset(), shape, stride)
    return view.detach()


def fuse_projections(model: nn.Module, copy: bool = True) -> int:
    """Fuse every module's same-input Linears (the modules that define `fuse_projections(copy)`) → how many
    groups were fused. Call it after the weights are loaded and before a decode pass is recorded; with
    `copy` False (a process whose weights are mapped from another's) only groups already back to back are.
    """
    owners = [m for m in model.modules() if hasattr(m, "fuse_projections")]
    fusers = [cast(Callable[[bool], bool], m.fuse_projections) for m in owners]
    fused = sum(int(fuse(copy)) for fuse in fusers)
    if copy and torch.cuda.is_available():
        torch.cuda.empty_cache()  # the unfused weights' blocks: give them back rather than keep them cached
    return fused
