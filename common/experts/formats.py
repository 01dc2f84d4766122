"""Runtime formats of routed experts. A format is a fixed set of named components of fixed shape and dtype
for a given (hidden H, intermediate I): one byte stride for every expert of a layer, in the host store and in
a cache slot. It packs one expert's SwiGLU weights (gate_up [2I, H], gate rows then up rows; down [H, I]) and
dequantises them back (`mlp`: the kernels' reference).

- bf16: gate_up [2I, H], down [H, I].
- fp8: e4m3 of the same shapes, `*_scale_inv` fp32 [ceil(out/128), ceil(in/128)] (Qwen3/DeepSeek FP8).
- int4: `*_qweight` uint8 [out, in/2], column 2j in byte j's low nibble, 2j+1 in its high one; `*_scales` bf16
  and `*_zeros` uint8 (0..15) [out, in/128]; w ≈ (q − zero) · scale. H and I multiples of 128.
- trellis2 … trellis4: trellis codes at 2 to 4 bits a weight (common/model/trellis_blocks.py).
- published formats (nvfp4, mxfp4, gptq*, awq*, ct-*): a checkpoint's experts kept in their own bits
  (fp4_blocks.py, int4_blocks.py, ct_experts.py in common/model/).
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from common.model.ct_experts import CT_EXPERT_FORMATS, CtExpertFormat
from common.model.fp4_blocks import (
    MXFP4_GROUP,
    NVFP4_GROUP,
    dequantize_mxfp4_experts,
    dequantize_nvfp4_experts,
    pack_nibbles,
    quantize_mxfp4,
    quantize_nvfp4,
)
from common.model.fp4_blocks import unpack_nibbles as unpack_nibbles  # re-exported: int4 shares the packing
from common.model.fp8_blocks import FP8_BLOCK, dequantize_fp8_block, exact_div, quantize_fp8_block
from common.model.int4_blocks import (
    dequantize_experts,
    expert_components,
    int4_format_name,
    pack_expert,
    parse_int4_format_name,
)
from common.model.trellis_blocks import TILE, TrellisCode, decode_matrix, encode_matrix, rotate

if TYPE_CHECKING:
    from common.kernels.moe_dense import Mixing

Components = dict[str, tuple[tuple[int, ...], torch.dtype]]

INT4_GROUP = 128
INT4_MAX = 15  # codes are 0..15


def _check_weights(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[int, int]:
    """(H, I) of one expert, after checking that gate_up [2I, H] and down [H, I] agree."""
    if gate_up.dim() != 2 or down.dim() != 2:
        raise ValueError(f"expected 2-D gate_up and down, got {tuple(gate_up.shape)} and {tuple(down.shape)}")
    hidden, inter = down.shape
    if tuple(gate_up.shape) != (2 * inter, hidden):
        raise ValueError(
            f"gate_up {tuple(gate_up.shape)} does not match down {tuple(down.shape)}: want [2I, H]"
        )
    return hidden, inter


class ExpertFormat(ABC):
    """How one routed expert is stored: named components of fixed shape and dtype, and their dequantisation.

    Subclasses define `components`, `pack`, `unpack_many` and `error_bound`; `unpack`, `mlp` and
    `expert_nbytes` follow from them.
    """

    name: str
    """"bf16" | "fp8" | "int4" | "nvfp4" | "mxfp4" | "gptq" | "awq" (…: `PublishedInt4Format`)."""
    dense_decode: bool = False
    """The dense decode kernels (common/kernels/moe_dense.py) read this format's rows in place."""
    dense_prefill: bool = False
    """The grouped dense prefill kernels (common/kernels/moe_dense_grouped.py) do."""
    kernel_param: int = 0
    """The dense kernels' constant for this format (`moe_dense_decode`'s `param`): GPTQ v1's 1, what a
    stored zero lacks; a trellis code's L · 256 + B."""

    def kernel_mixing(self) -> Mixing | None:
        """The rotations the dense kernels take around a pool of this format (`moe_dense_decode`'s
        `mixing`): None but for trellis codes."""
        return None

    @abstractmethod
    def components(self, hidden: int, inter: int) -> Components:
        """Per-expert component name -> (shape, dtype); fixed for a given (hidden, inter).

        Raises ValueError if the format cannot hold experts of these dims.
        """

    @abstractmethod
    def pack(self, gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
        """One expert's weights (gate_up [2I, H], down [H, I], any float dtype) -> its components.

        Shapes and dtypes are those of `components(H, I)`; tensors are contiguous and on the input's device.
        Deterministic: the same weights always give the same bytes.
        """

    @abstractmethod
    def unpack_many(
        self, parts: Mapping[str, torch.Tensor], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Components of N experts, each with a leading expert dim [N, ...] -> (gate_up [N, 2I, H],
        down [N, H, I]) dequantised in dtype, on the components' device."""

    @abstractmethod
    def error_bound(self) -> float:
        """Bound on the relative Frobenius error ||w' − w|| / ||w|| of pack→unpack (float32) for Gaussian
        weights of any scale, per weight matrix (see `quantization_error`)."""

    def unpack(
        self, parts: Mapping[str, torch.Tensor], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Components of one expert -> dequantised (gate_up [2I, H], down [H, I]) in dtype."""
        gate_up, down = self.unpack_many({k: v.unsqueeze(0) for k, v in parts.items()}, dtype)
        return gate_up[0], down[0]

    def mlp(
        self,
        x: torch.Tensor,
        parts: Mapping[str, torch.Tensor],
        act: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Reference expert MLP on x [n, H] reading this format -> [n, H] in x's dtype.

        Dequantises to x's dtype, then the two matmuls of `grouped_expert_mlp`, so the result is bitwise that
        of `grouped_expert_mlp` on `unpack(parts, x.dtype)`. Runs wherever x and parts are (CPU or CUDA).
        """
        gate_up, down = self.unpack(parts, x.dtype)  # [2I, H], [H, I]
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)  # [n, I] each
        return F.linear(act(gate) * up, down)  # [n, H]

    def expert_nbytes(self, hidden: int, inter: int) -> int:
        """Bytes of one expert in this format: the stride of an expert in the host store and a cache slot."""
        comps = self.components(hidden, inter).values()
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in comps)


# --- bf16 -------------------------------------------------------------------------------------------------


class Bf16Format(ExpertFormat):
    """The checkpoint's weights in bf16: exact for bf16 input."""

    name = "bf16"
    dense_decode = dense_prefill = True

    def components(self, hidden: int, inter: int) -> Components:
        return {"gate_up": ((2 * inter, hidden), torch.bfloat16), "down": ((hidden, inter), torch.bfloat16)}

    def pack(self, gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
        _check_weights(gate_up, down)
        return {
            "gate_up": gate_up.to(torch.bfloat16).contiguous(),
            "down": down.to(torch.bfloat16).contiguous(),
        }

    def unpack_many(
        self, parts: Mapping[str, torch.Tensor], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return parts["gate_up"].to(dtype), parts["down"].to(dtype)

    def error_bound(self) -> float:
        # Round-to-nearest bf16 (8 significant bits) errs by ≤ 2^-9 relative per element; 0 for bf16 input.
        return 2.0**-8


# --- fp8 e4m3, 128×128 block scales (common/model/fp8_blocks.py) ----------------------------------------


class Fp8Format(ExpertFormat):
    """fp8 e4m3 weights with fp32 inverse scales per 128×128 block (Qwen3/DeepSeek FP8 checkpoint layout)."""

    name = "fp8"
    dense_decode = dense_prefill = True

    def components(self, hidden: int, inter: int) -> Components:
        comps: Components = {}
        for key, (out, inp) in (("gate_up", (2 * inter, hidden)), ("down", (hidden, inter))):
            comps[key] = ((out, inp), torch.float8_e4m3fn)
            comps[f"{key}_scale_inv"] = ((-(-out // FP8_BLOCK), -(-inp // FP8_BLOCK)), torch.float32)
        return comps

    def pack(self, gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
        _check_weights(gate_up, down)
        parts: dict[str, torch.Tensor] = {}
        for key, w in (("gate_up", gate_up), ("down", down)):
            parts[key], parts[f"{key}_scale_inv"] = quantize_fp8_block(w)
        return parts

    def unpack_many(
        self, parts: Mapping[str, torch.Tensor], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up = dequantize_fp8_block(
            parts["gate_up"], parts["gate_up_scale_inv"], dtype=dtype
        )  # [N, 2I, H]
        down = dequantize_fp8_block(parts["down"], parts["down_scale_inv"], dtype=dtype)  # [N, H, I]
        return gate_up, down

    def error_bound(self) -> float:
        # e4m3 keeps 4 significant bits (≤ 2^-4 relative per element); the relative error on Gaussian weights
        # of any std (tests/common/experts/test_formats.py) stays under this with margin.
        return 0.035


# --- int4 W4A16, group 128 along the input dim, asymmetric -------------------------------------------------


def quantize_int4_groups(
    weight: torch.Tensor, group: int = INT4_GROUP
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [..., out, in] (in % group == 0) -> (qweight uint8 [..., out, in/2], scales bf16
    [..., out, in/group], zeros uint8 [..., out, in/group]) with w ≈ (q − zero) · scale.

    Each group's range is widened to include 0 (as GPTQ does), so 0 is exact and the zero point lies in
    0..15. The scale is rounded to bf16 before the codes are chosen, so codes match the stored scale.
    """
    out, inp = weight.shape[-2:]
    if inp % group:
        raise ValueError(f"int4 needs the input dim to be a multiple of {group}, got {inp}")
    w = weight.float().view(*weight.shape[:-2], out, inp // group, group)  # [..., out, G, group]
    lo = w.amin(dim=-1).clamp(max=0.0)  # [..., out, G]
    hi = w.amax(dim=-1).clamp(min=0.0)
    span = hi - lo
    scale = torch.where(span > 0, exact_div(span, INT4_MAX), torch.ones_like(span)).to(torch.bfloat16)
    scale = scale.clamp(min=torch.finfo(torch.bfloat16).tiny)  # an underflowed scale would divide by 0
    s = scale.float()[..., None]  # [..., out, G, 1]
    zero = torch.round(-lo[..., None] / s).clamp(0, INT4_MAX)  # [..., out, G, 1]
    q = (torch.round(w / s) + zero).clamp(0, INT4_MAX).to(torch.uint8)  # [..., out, G, group]
    return pack_nibbles(q.view(*weight.shape)), scale.contiguous(), zero[..., 0].to(torch.uint8).contiguous()


def dequantize_int4_groups(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """(qweight uint8 [..., out, in/2], scales [..., out, G], zeros [..., out, G]) -> (q − zero) · scale
    [..., out, in] in dtype, the product formed in fp32 (exact: 4-bit × bf16) and rounded once."""
    codes = unpack_nibbles(qweight)  # [..., out, in]
    inp = codes.shape[-1]
    groups = scales.shape[-1]
    q = codes.view(*codes.shape[:-1], groups, inp // groups).float()  # [..., out, G, group]
    w = (q - zeros.float()[..., None]) * scales.float()[..., None]
    return w.view(*codes.shape).to(dtype)


class Int4Format(ExpertFormat):
    """W4A16 int4: asymmetric, group 128 along the input dim, bf16 scales and uint8 zero points."""

    name = "int4"

    def components(self, hidden: int, inter: int) -> Components:
        if hidden % INT4_GROUP or inter % INT4_GROUP:
            raise ValueError(
                f"int4 needs hidden and intermediate sizes that are multiples of {INT4_GROUP}, "
                f"got hidden={hidden}, inter={inter}"
            )
        comps: Components = {}
        for key, (out, inp) in (("gate_up", (2 * inter, hidden)), ("down", (hidden, inter))):
            comps[f"{key}_qweight"] = ((out, inp // 2), torch.uint8)
            comps[f"{key}_scales"] = ((out, inp // INT4_GROUP), torch.bfloat16)
            comps[f"{key}_zeros"] = ((out, inp // INT4_GROUP), torch.uint8)
        return comps

    def pack(self, gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden, inter = _check_weights(gate_up, down)
        self.components(hidden, inter)  # the dim check
        parts: dict[str, torch.Tensor] = {}
        for key, w in (("gate_up", gate_up), ("down", down)):
            parts[f"{key}_qweight"], parts[f"{key}_scales"], parts[f"{key}_zeros"] = quantize_int4_groups(w)
        return parts

    def unpack_many(
        self, parts: Mapping[str, torch.Tensor], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        weights = [
            dequantize_int4_groups(parts[f"{k}_qweight"], parts[f"{k}_scales"], parts[f"{k}_zeros"], dtype)
            for k in ("gate_up", "down")
        ]
        return weights[0], weights[1]  # [N, 2I, H], [N, H, I]

    def error_bound(self) -> float:
        # Round-to-nearest over the min-max range: a Gaussian group of 128 spans ~5.2σ, a step is ~0.35σ and
        # the rms error step/√12 ≈ 0.1σ. Measured 10.0-10.2 % for Gaussian weights of any std (0.02, 1, 1e-30,
        # 1e20; see tests/common/experts/test_formats.py), bound with margin.
        return 0.12


# --- NVFP4 and MXFP4: published 4-bit float formats (common/model/fp4_blocks.py) -------------------------


class Nvfp4Format(ExpertFormat):
    """NVFP4 as ModelOpt exports it (common/model/fp4_blocks.py), per linear `weight`, `weight_scale`,
    `weight_scale_2` and `input_scale` (the activations' global scale for W4A4 compute, kept as published,
    unused by weight-only compute); gate and up keep a global scale each ([2]: gate's, up's), as ModelOpt
    exports an expert's linears (not fused). H and I multiples of 16."""

    name = "nvfp4"
    dense_decode = dense_prefill = True

    def components(self, hidden: int, inter: int) -> Components:
        if hidden % NVFP4_GROUP or inter % NVFP4_GROUP:
            raise ValueError(f"nvfp4 needs hidden and intermediate sizes that are multiples of {NVFP4_GROUP}")
        comps: Components = {}
        for key, (out, inp), tensors in (("gate_up", (2 * inter, hidden), 2), ("down", (hidden, inter), 1)):
            comps[f"{key}_weight"] = ((out, inp // 2), torch.uint8)
            comps[f"{key}_weight_scale"] = ((out, inp // NVFP4_GROUP), torch.float8_e4m3fn)
            comps[f"{key}_weight_scale_2"] = ((tensors,), torch.float32)
            comps[f"{key}_input_scale"] = ((tensors,), torch.float32)
        return comps

    def pack(self, gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
        """gate and up keep a global scale each (ModelOpt does not fuse an expert's linears); input_scale 1
        (no activations to calibrate)."""
        hidden, inter = _check_weights(gate_up, down)
        self.components(hidden, inter)  # the dim check
        parts: dict[str, torch.Tensor] = {}
        for key, ws in (("gate_up", gate_up.split(inter)), ("down", (down,))):
            packed = [quantize_nvfp4(w) for w in ws]
            parts[f"{key}_weight"] = torch.cat([p[0] for p in packed]).to(gate_up.device)
            parts[f"{key}_weight_scale"] = torch.cat([p[1] for p in packed]).to(gate_up.device)
            parts[f"{key}_weight_scale_2"] = torch.stack([p[2] for p in packed]).to(gate_up.device)
            parts[f"{key}_input_scale"] = torch.ones(len(ws), device=gate_up.device)
        return parts

    def unpack_many(
        self, parts: Mapping[str, torch.Tensor], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up, down = dequantize_nvfp4_experts(parts, dtype)
        return gate_up, down  # [N, 2I, H], [N, H, I]

    def error_bound(self) -> float:
        # 1 + 3 bits per element, the block scale in e4m3: ~9 % rms on Gaussian weights, bound with margin.
        return 0.13


class Mxfp4Format(ExpertFormat):
    """MXFP4 as gpt-oss releases it (common/model/fp4_blocks.py); H and I multiples of 32."""

    name = "mxfp4"
    dense_decode = dense_prefill = True

    def components(self, hidden: int, inter: int) -> Components:
        if hidden % MXFP4_GROUP or inter % MXFP4_GROUP:
            raise ValueError(f"mxfp4 needs hidden and intermediate sizes that are multiples of {MXFP4_GROUP}")
        comps: Components = {}
        for key, (out, inp) in (("gate_up", (2 * inter, hidden)), ("down", (hidden, inter))):
            comps[f"{key}_blocks"] = ((out, inp // MXFP4_GROUP, MXFP4_GROUP // 2), torch.uint8)
            comps[f"{key}_scales"] = ((out, inp // MXFP4_GROUP), torch.uint8)
        return comps

    def pack(self, gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden, inter = _check_weights(gate_up, down)
        self.components(hidden, inter)  # the dim check
        parts: dict[str, torch.Tensor] = {}
        for key, w in (("gate_up", gate_up), ("down", down)):
            parts[f"{key}_blocks"], parts[f"{key}_scales"] = quantize_mxfp4(w)
        return parts

    def unpack_many(
        self, parts: Mapping[str, torch.Tensor], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up, down = dequantize_mxfp4_experts(parts, dtype)
        return gate_up, down  # [N, 2I, H], [N, H, I]

    def error_bound(self) -> float:
        # Power-of-two block scales waste up to a bit of range: ~12 % rms on Gaussian weights, with margin.
        return 0.18


class PublishedInt4Format(ExpertFormat):
    """GPTQ (v1 or v2 zeros) or AWQ GEMM int4 experts as published (common/model/int4_blocks.py), gate's and
    up's tensors joined along the outputs; `pack` rounds to nearest (GPTQ symmetric, inputs in order)."""

    def __init__(self, method: str, group: int) -> None:
        self.method, self.group = method, group
        self.name = int4_format_name(method, group)
        self.dense_decode = self.dense_prefill = True
        self.kernel_param = int(method == "gptq")

    def components(self, hidden: int, inter: int) -> Components:
        try:
            return expert_components(self.method, self.group, hidden, inter)
        except ValueError as exc:
            raise ValueError(f"{self.name}: {exc}") from None

    def pack(self, gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden, inter = _check_weights(gate_up, down)
        self.components(hidden, inter)  # the dim check
        return pack_expert(self.method, self.group, gate_up, down)

    def unpack_many(
        self, parts: Mapping[str, torch.Tensor], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return dequantize_experts(self.method, parts, dtype)  # [N, 2I, H], [N, H, I]

    def error_bound(self) -> float:
        # 16 levels over each group's range with fp16 scales: ~10 % rms on Gaussian weights (groups of 32 up
        # to a whole row of a few hundred), bound with margin; weights within fp16's range.
        return 0.13


class CtFormat(ExpertFormat):
    """A compressed-tensors expert format (common/model/ct_experts.py, where its loader reads it too)."""

    def __init__(self, spec: CtExpertFormat) -> None:
        self.spec, self.name = spec, spec.name
        self.dense_decode = self.dense_prefill = True

    def components(self, hidden: int, inter: int) -> Components:
        return self.spec.components(hidden, inter)

    def pack(self, gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.spec.pack(gate_up, down)

    def unpack_many(
        self, parts: Mapping[str, torch.Tensor], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.spec.unpack_many(parts, dtype)

    def error_bound(self) -> float:
        return self.spec.error_bound()


# --- trellis: QTIP-style codes at 2 to 4 bits a weight (common/model/trellis_blocks.py) ---------------------


TRELLIS_RATES = {"2": 4, "2.5": 5, "3": 6, "3.5": 7, "4": 8}
"""Bits a weight (as a format name writes them) -> bits a trellis step of two weights."""
_TRELLIS_NAME = re.compile(r"^trellis(2|2\.5|3|3\.5|4)(?:-l(\d+))?$")


class TrellisFormat(ExpertFormat):
    """Trellis-coded experts (trellis_blocks.py): `*_codes` uint8 [out, in·B/16] (B / 2 bits a weight, tiles
    of 128 inputs), `*_scales` fp16 [out] (the rotated rows' rms). H and I multiples of 128. `state_bits` L
    (16 by default; fewer encode faster and code worse) is in the name when not 16: "trellis3-l12"."""

    def __init__(self, rate: str, state_bits: int = 16) -> None:
        self.code = TrellisCode(state_bits, TRELLIS_RATES[rate])
        self.name = f"trellis{rate}" + ("" if state_bits == 16 else f"-l{state_bits}")
        self.dense_decode, self.kernel_param = True, state_bits * 256 + self.code.step_bits

    def kernel_mixing(self) -> Mixing:
        """The rotations of `encode_matrix` (trellis_blocks.rotate): inputs in, outputs back."""
        from common.kernels.moe_dense import Mixing  # Triton: only where the kernels run

        return Mixing(into=lambda v: rotate(v, "in"), back=lambda v: rotate(v, "out", inverse=True))

    def components(self, hidden: int, inter: int) -> Components:
        if hidden % TILE or inter % TILE:
            raise ValueError(f"{self.name} needs hidden and intermediate sizes that are multiples of {TILE}")
        b = self.code.step_bits
        comps: Components = {}
        for key, (out, inp) in (("gate_up", (2 * inter, hidden)), ("down", (hidden, inter))):
            comps[f"{key}_codes"] = ((out, inp * b // 16), torch.uint8)
            comps[f"{key}_scales"] = ((out,), torch.float16)
        return comps

    def pack(self, gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden, inter = _check_weights(gate_up, down)
        self.components(hidden, inter)  # the dim check
        parts: dict[str, torch.Tensor] = {}
        for key, w in (("gate_up", gate_up), ("down", down)):
            parts[f"{key}_codes"], parts[f"{key}_scales"] = encode_matrix(w, self.code)
        return parts

    def unpack_many(
        self, parts: Mapping[str, torch.Tensor], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up, down = (
            decode_matrix(parts[f"{key}_codes"], parts[f"{key}_scales"], self.code).to(dtype)
            for key in ("gate_up", "down")
        )
        return gate_up, down  # [N, 2I, H], [N, H, I]

    def error_bound(self) -> float:
        # Gaussian MSE measured 0.075 at 2 bits (L 16) down to 0.006 at 4 (bench/results/expert-formats.json);
        # the bound is the 2-bit rms with margin, and at most 0.35 for short states.
        return 0.35 if self.code.state_bits < 16 else 0.3


def parse_trellis_format_name(name: str) -> TrellisFormat | None:
    """The trellis format a name like "trellis2.5" or "trellis3-l12" means, else None."""
    m = _TRELLIS_NAME.match(name)
    return TrellisFormat(m[1], int(m[2] or 16)) if m else None


# --- registry ----------------------------------------------------------------------------------------------

FORMATS: dict[str, ExpertFormat] = {f.name: f for f in (Bf16Format(), Fp8Format(), Int4Format())}
PACKED_FORMATS = (*FORMATS, *(f"trellis{rate}" for rate in TRELLIS_RATES))
"""What `--expert-format` packs a checkpoint's bf16 experts in at load (a published checkpoint keeps its
own)."""


PUBLISHED_FORMATS: dict[str, ExpertFormat] = {
    f.name: f
    for f in (
        Nvfp4Format(),
        Mxfp4Format(),
        PublishedInt4Format("gptq", 128),
        PublishedInt4Format("awq", 128),
        *map(CtFormat, CT_EXPERT_FORMATS.values()),
    )
}
"""Formats a checkpoint publishes its experts in, kept in their bits (not packed from bf16 by
`--expert-format`; on CUDA the dense kernels read them, common/kernels/moe_dense*.py)."""


def get_format(name: str) -> ExpertFormat:
    """The format called name (in FORMATS or PUBLISHED_FORMATS, or a trellis code: "trellis3",
    "trellis2.5-l12"); ValueError naming the allowed ones otherwise."""
    known = {**FORMATS, **PUBLISHED_FORMATS}
    int4 = parse_int4_format_name(name)  # another group size or zero convention: e.g. "gptq-g32"
    if name not in known and int4 is not None:
        return PublishedInt4Format(*int4)
    trellis = parse_trellis_format_name(name)
    if trellis is not None:
        return trellis
    try:
        return known[name]
    except KeyError:
        trellis_names = ", ".join(f"trellis{rate}" for rate in TRELLIS_RATES)
        raise ValueError(
            f"unknown expert format {name!r}; allowed: {', '.join(known)}, {trellis_names}"
        ) from None


def quantization_error(fmt: ExpertFormat, gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, float]:
    """Relative Frobenius error ||w' − w|| / ||w|| of each weight after pack→unpack (float32), by name
    ("gate_up", "down"); 0 for an all-zero weight that comes back zero."""
    restored = fmt.unpack(fmt.pack(gate_up, down), torch.float32)
    errors: dict[str, float] = {}
    for key, w, w2 in zip(("gate_up", "down"), (gate_up, down), restored, strict=True):
        ref = w.double()
        diff = torch.linalg.vector_norm(w2.double() - ref).item()
        norm = torch.linalg.vector_norm(ref).item()
        errors[key] = diff / norm if norm > 0 else diff
    return errors
