"""Block-scaled fp8 weights (e4m3, one fp32 inverse scale per 128×128 block): the layout of Qwen3 and
DeepSeek FP8 checkpoints, read by the loader and written by the synthetic checkpoints and the expert formats.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def exact_div(a: torch.Tensor, divisor: float) -> torch.Tensor:
    """a / divisor correctly rounded on every device: CUDA turns division by a Python scalar into a multiply
    by its reciprocal (1/448 and 1/15 are inexact), which would make packed bytes differ from the CPU's."""
    return a / torch.full_like(a, divisor)


def check_fp8_scale(weight: torch.Tensor, scale_inv: torch.Tensor, block: int) -> None:
    out, inp = weight.shape[-2:]
    want = (*weight.shape[:-2], -(-out // block), -(-inp // block))
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"scale_inv {tuple(scale_inv.shape)} does not fit weight {tuple(weight.shape)}: want {want}"
        )


def quantize_fp8_block(weight: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., out, in] (any float dtype) -> (float8_e4m3fn [..., out, in], scale_inv fp32
    [..., ceil(out/block), ceil(in/block)]) with scale_inv = amax(block) / 448.

    Edge blocks are partial; an all-zero block gets scale_inv 1.
    """
    out, inp = weight.shape[-2:]
    lead = weight.shape[:-2]
    rb, cb = -(-out // block), -(-inp // block)
    # Zero padding to whole blocks leaves each edge block's amax unchanged.
    w = F.pad(weight.float(), (0, cb * block - inp, 0, rb * block - out))  # [..., rb*block, cb*block]
    w = w.view(*lead, rb, block, cb, block)
    amax = w.abs().amax(dim=(-3, -1))  # [..., rb, cb]
    scale_inv = torch.where(amax > 0, exact_div(amax, FP8_MAX), torch.ones_like(amax))
    # Clamp: amax / (amax / 448) may land a hair above 448, and e4m3fn has no inf (it would cast to NaN).
    q = (w / scale_inv[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.view(*lead, rb * block, cb * block)[..., :out, :inp].contiguous()
    return q, scale_inv.contiguous()


def dequantize_fp8_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Block-scaled fp8 (as in HF FP8 checkpoints: `weight` fp8 [..., out, in], `weight_scale_inv`
    [..., ceil(out/block), ceil(in/block)]) -> weight · scale_inv of its block, in dtype.

    out and in need not be multiples of block (edge blocks are partial). The product is formed in fp32 and
    rounded once to dtype.
    """
    check_fp8_scale(weight, scale_inv, block)
    out, inp = weight.shape[-2:]
    rows = torch.arange(out, device=weight.device) // block  # [out] block row of each row
    cols = torch.arange(inp, device=weight.device) // block  # [in] block column of each column
    scale = scale_inv.float().index_select(-2, rows).index_select(-1, cols)  # [..., out, in]
    return (weight.float() * scale).to(dtype)
