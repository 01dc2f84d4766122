"""Int4 weights as GPTQ and AWQ checkpoints publish them.

Both pack eight 4-bit codes into an int32 word, code k of a word in bits 4k..4k+3, and dequantise
w = (q − zero) · scale per group of inputs, the scales fp16 [G, out] (G = in / group_size; one group of all
inputs when group_size is -1), stored input-major:

- GPTQ (AutoGPTQ, GPTQModel): `qweight` int32 [in/8, out], word r of a column holding inputs 8r..8r+7 in
  order; `qzeros` int32 [G, out/8], word c of a row holding outputs 8c..8c+7 in order; `scales`; `g_idx`
  int32 [in], the group of each input (i // group_size, or with `desc_act` a permuted assignment). The
  "gptq" checkpoint_format (v1) stores zero − 1 in each nibble (read back + 1, 15 as 16), GPTQModel's
  "gptq_v2" the zero itself.
- AWQ GEMM (AutoAWQ): `qweight` int32 [in, out/8] and `qzeros` int32 [G, out/8], word c of a row holding
  outputs 8c + (0, 2, 4, 6, 1, 3, 5, 7)[k] in nibble k; `scales`; the zero itself; groups contiguous.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence

import torch

INT4_METHODS = ("gptq", "gptq_v2", "awq")
"""Published int4 layouts: GPTQ's v1 and v2 zero conventions, AWQ GEMM."""
DEFAULT_GROUP = 128
_WORD = 8  # codes an int32 word holds
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""Nibble k of an AWQ word holds output column 8c + AWQ_ORDER[k]."""
_NAME = re.compile(r"^(gptq_v2|gptq|awq)(?:-g(-1|[1-9]\d*))?$")

Components = dict[str, tuple[tuple[int, ...], torch.dtype]]


# --- names ---------------------------------------------------------------------------------------------


def int4_format_name(method: str, group: int) -> str:
    """The expert format's name: "gptq" / "gptq_v2" / "awq" for group 128, else e.g. "gptq-g32"."""
    return method if group == DEFAULT_GROUP else f"{method}-g{group}"


def parse_int4_format_name(name: str) -> tuple[str, int] | None:
    """(method, group_size) of an int4 format name (`int4_format_name`'s form), else None."""
    m = _NAME.match(name)
    return None if m is None else (m[1], int(m[2]) if m[2] else DEFAULT_GROUP)


def num_groups(inp: int, group: int) -> int:
    """G of a linear with `inp` inputs; ValueError if the groups do not tile the inputs."""
    if group == -1:
        return 1
    if group <= 0 or inp % group:
        raise ValueError(f"the input dim {inp} is not a multiple of the group size {group}")
    return inp // group


def linear_names(method: str) -> tuple[str, ...]:
    """The suffix names of a linear's published tensors."""
    return ("qweight", "qzeros", "scales") if method == "awq" else ("qweight", "qzeros", "scales", "g_idx")


def linear_shapes(method: str, group: int, out: int, inp: int) -> Components:
    """A linear's published tensors by suffix name -> (shape, dtype); ValueError for dims the layout cannot
    take (out and in multiples of 8, in of the group size)."""
    if out % _WORD or inp % _WORD:
        raise ValueError(f"{method} needs dims that are multiples of {_WORD}, got out={out}, in={inp}")
    g = num_groups(inp, group)
    if method == "awq":
        qweight = (inp, out // _WORD)
        return {
            "qweight": (qweight, torch.int32),
            "qzeros": ((g, out // _WORD), torch.int32),
            "scales": ((g, out), torch.float16),
        }
    return {
        "qweight": ((inp // _WORD, out), torch.int32),
        "qzeros": ((g, out // _WORD), torch.int32),
        "scales": ((g, out), torch.float16),
        "g_idx": ((inp,), torch.int32),
    }


# --- int32 words of eight nibbles --------------------------------------------------------------------------


def pack_int32(codes: torch.Tensor, dim: int, order: Sequence[int] | None = None) -> torch.Tensor:
    """Codes 0..15 [..., n, ...] (n % 8 == 0 along `dim`) -> int32 words [..., n/8, ...]: nibble k of word c
    holds code 8c + order[k] (order: 0..7 unless given)."""
    c = codes.movedim(dim, -1).to(torch.int64)
    c = c.reshape(*c.shape[:-1], c.shape[-1] // _WORD, _WORD)
    if order is not None:
        c = c[..., list(order)]
    shifts = torch.arange(0, 32, 4, device=c.device)
    word = (c << shifts).sum(dim=-1)  # 0 .. 2^32 − 1
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)  # the same bits as int32
    return word.movedim(-1, dim).contiguous()


def unpack_int32(words: torch.Tensor, dim: int, order: Sequence[int] | None = None) -> torch.Tensor:
    """int32 words [..., n/8, ...] -> int32 codes 0..15 [..., n, ...] along `dim`; the inverse of
    `pack_int32` with the same order."""
    w = words.movedim(dim, -1)
    shifts = _shifts(tuple(order or range(_WORD)), str(w.device))  # code j's nibble: order.index(j)
    nibbles = (w.unsqueeze(-1) >> shifts) & 0xF  # [..., n/8, 8] in code order
    return nibbles.flatten(-2).movedim(-1, dim)


@functools.cache
def _shifts(order: tuple[int, ...], device: str) -> torch.Tensor:
    """The bit shift of each code's nibble in a word packed in `order`, on `device` (made once: a decode
    step copies nothing from the host)."""
    return torch.tensor([4 * order.index(j) for j in range(_WORD)], dtype=torch.int32, device=device)


# --- one linear ----------------------------------------------------------------------------------------


def dequantize_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    dtype: torch.dtype,
    v2: bool = False,
) -> torch.Tensor:
    """GPTQ tensors (leading dims allowed) -> w [..., out, in] in dtype: input i of output o is
    (q − zero) · scale of group g_idx[i], the zero read + 1 in v1."""
    q = unpack_int32(qweight, dim=-2)  # [..., in, out]
    zeros = unpack_int32(qzeros, dim=-1) + (0 if v2 else 1)  # [..., G, out]
    idx = g_idx.long().unsqueeze(-1)  # [..., in, 1]
    z = torch.take_along_dim(zeros, idx, dim=-2)  # [..., in, out]
    s = torch.take_along_dim(scales.float(), idx, dim=-2)
    return ((q - z).float() * s).transpose(-1, -2).to(dtype)


def dequantize_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """AWQ GEMM tensors (leading dims allowed) -> w [..., out, in] in dtype, groups contiguous."""
    q = unpack_int32(qweight, dim=-1, order=AWQ_ORDER)  # [..., in, out]
    zeros = unpack_int32(qzeros, dim=-1, order=AWQ_ORDER)  # [..., G, out]
    size = q.shape[-2] // zeros.shape[-2]
    z = zeros.repeat_interleave(size, dim=-2)  # [..., in, out]
    s = scales.float().repeat_interleave(size, dim=-2)
    return ((q - z).float() * s).transpose(-1, -2).to(dtype)


def _fp16_scale(span: torch.Tensor) -> torch.Tensor:
    """Per-group scales in fp16, an empty group's 1 and none rounded to 0 (which would divide by 0)."""
    scale = torch.where(span > 0, span / 15, torch.ones_like(span)).to(torch.float16)
    return scale.clamp(min=torch.finfo(torch.float16).tiny)


def quantize_gptq(
    weight: torch.Tensor,
    group: int,
    sym: bool = True,
    perm: torch.Tensor | None = None,
    v2: bool = False,
) -> dict[str, torch.Tensor]:
    """weight [out, in] -> {qweight, qzeros, scales, g_idx} by round to nearest, the ranges as GPTQ's
    quantizer takes them: each group's range widened to include 0 (±1 for an all-zero group); `sym` keeps
    it symmetric with zero 8. `perm` (desc_act) is the order in which inputs fill the groups: input perm[j]
    falls in group j // group_size. v1 cannot store a zero of 0, so an asymmetric group's zero is at least 1
    there."""
    out, inp = weight.shape
    size = inp if group == -1 else group
    g = num_groups(inp, group)
    order = torch.arange(inp) if perm is None else perm.cpu().long()
    g_idx = torch.empty(inp, dtype=torch.int32)
    g_idx[order] = (torch.arange(inp) // size).to(torch.int32)
    w = weight.float().cpu()[:, order].reshape(out, g, size)  # [out, G, size] in fill order
    lo, hi = w.amin(dim=-1).clamp(max=0.0), w.amax(dim=-1).clamp(min=0.0)
    if sym:
        hi = torch.maximum(hi, -lo)
        lo = torch.where(lo < 0, -hi, lo)
    empty = (lo == 0) & (hi == 0)
    lo, hi = torch.where(empty, -1.0, lo), torch.where(empty, 1.0, hi)
    scale = _fp16_scale(hi - lo)  # [out, G]
    if sym:
        zero = torch.full_like(scale, 8, dtype=torch.float32)
    else:
        zero = torch.round(-lo / scale.float()).clamp(0 if v2 else 1, 15)
    codes = (torch.round(w / scale.float()[..., None]) + zero[..., None]).clamp(0, 15).to(torch.int32)
    q = torch.empty(out, inp, dtype=torch.int32)
    q[:, order] = codes.reshape(out, inp)
    stored = (zero - (0 if v2 else 1)).to(torch.int32)
    return {
        "qweight": pack_int32(q.T, dim=0),  # [in/8, out]
        "qzeros": pack_int32(stored.T, dim=-1),  # [G, out/8]
        "scales": scale.T.contiguous(),  # [G, out]
        "g_idx": g_idx,
    }


def quantize_awq(weight: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """weight [out, in] -> {qweight, qzeros, scales} by round to nearest over each group's min..max, as
    AutoAWQ's quantizer with zero_point (the zero −round(min / scale), clamped to 0..15)."""
    out, inp = weight.shape
    size = inp if group == -1 else group
    g = num_groups(inp, group)
    w = weight.float().cpu().reshape(out, g, size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = _fp16_scale(hi - lo)  # [out, G]
    zero = (-torch.round(lo / scale.float())).clamp(0, 15)
    codes = (torch.round(w / scale.float()[..., None]) + zero[..., None]).clamp(0, 15).to(torch.int32)
    return {
        "qweight": pack_int32(codes.reshape(out, inp).T, dim=-1, order=AWQ_ORDER),  # [in, out/8]
        "qzeros": pack_int32(zero.to(torch.int32).T, dim=-1, order=AWQ_ORDER),  # [G, out/8]
        "scales": scale.T.contiguous(),  # [G, out]
    }


def quantize_linear(
    method: str, weight: torch.Tensor, group: int, sym: bool = True, perm: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """One linear's published tensors by suffix name (`sym` and `perm`: GPTQ's, see `quantize_gptq`)."""
    if method == "awq":
        return quantize_awq(weight, group)
    return quantize_gptq(weight, group, sym=sym, perm=perm, v2=method == "gptq_v2")


def dequantize_linear(method: str, parts: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """One linear's published tensors (by suffix name, leading dims allowed) -> w [..., out, in]."""
    if method == "awq":
        return dequantize_awq(parts["qweight"], parts["qzeros"], parts["scales"], dtype)
    return dequantize_gptq(
        parts["qweight"], parts["qzeros"], parts["scales"], parts["g_idx"], dtype, v2=method == "gptq_v2"
    )


# --- a routed expert: gate and up joined along the outputs ----------------------------------------------


def expert_components(method: str, group: int, hidden: int, inter: int) -> Components:
    """An expert's components: `{gate_up,down}_{qweight,qzeros,scales}` as one linear's of 2I (gate's
    outputs, then up's) and H outputs; GPTQ's `g_idx` one row a linear ([2, H] and [1, I])."""
    comps: Components = {}
    for part, out, inp, pieces in (("gate_up", inter, hidden, 2), ("down", hidden, inter, 1)):
        for name, (shape, dtype) in linear_shapes(method, group, out, inp).items():
            joined = (pieces, *shape) if name == "g_idx" else (*shape[:-1], pieces * shape[-1])
            comps[f"{part}_{name}"] = (joined, dtype)
    return comps


def join_pieces(name: str, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """One expert's component from its linears' tensors (gate then up; or down alone)."""
    return torch.stack(list(pieces)) if name == "g_idx" else torch.cat(list(pieces), dim=-1)


def _split(parts: Mapping[str, torch.Tensor], part: str, pieces: int) -> list[dict[str, torch.Tensor]]:
    """A joined component set [N, ...] -> each linear's tensors [N, ...]."""
    out = []
    for i in range(pieces):
        one = {}
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            t = parts.get(f"{part}_{name}")
            if t is not None:
                width = t.shape[-1] // pieces
                one[name] = t[..., i, :] if name == "g_idx" else t[..., i * width : (i + 1) * width]
        out.append(one)
    return out


def pack_expert(
    method: str, group: int, gate_up: torch.Tensor, down: torch.Tensor
) -> dict[str, torch.Tensor]:
    """One expert's weights (gate_up [2I, H], down [H, I]) -> its components, each linear quantized as
    `quantize_linear` does (GPTQ symmetric, inputs in order)."""
    inter = down.shape[1]
    parts: dict[str, torch.Tensor] = {}
    for part, linears in (("gate_up", gate_up.split(inter)), ("down", (down,))):
        packed = [quantize_linear(method, w, group) for w in linears]
        for name in packed[0]:
            parts[f"{part}_{name}"] = join_pieces(name, [p[name] for p in packed]).to(down.device)
    return parts


def dequantize_experts(
    method: str, parts: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """N experts' components (leading dim N) -> (gate_up [N, 2I, H], down [N, H, I]) in dtype."""
    out = []
    for part, pieces in (("gate_up", 2), ("down", 1)):
        linears = _split(parts, part, pieces)
        out.append(torch.cat([dequantize_linear(method, p, dtype) for p in linears], dim=-2))
    return out[0], out[1]
