"""compressed-tensors' layouts (common/model/ct_blocks.py) against compressed-tensors' own packing,
quantisation and decompression: the same bytes, and the same weights bit for bit."""

from __future__ import annotations

import pytest
import torch

from common.model.ct_blocks import (
    ct_nvfp4_global_scale,
    dequantize_ct_nvfp4,
    dequantize_w4a16,
    e2m1_round,
    pack_int32,
    pack_int32_rows,
    quantize_ct_nvfp4,
    quantize_w4a16,
    unpack_int32,
    unpack_int32_rows,
)
from common.model.fp4_blocks import pack_nibbles

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import NVFP4PackedCompressor, PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, dequantize  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam  # noqa: E402
from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4  # noqa: E402


def w4a16_scheme(group: int, symmetric: bool) -> QuantizationScheme:
    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=group, symmetric=symmetric)
    return QuantizationScheme(targets=["Linear"], weights=args)


def nvfp4_scheme() -> QuantizationScheme:
    args = QuantizationArgs(
        num_bits=4,
        type="float",
        strategy="tensor_group",
        group_size=16,
        symmetric=True,
        scale_dtype=torch.float8_e4m3fn,
    )
    return QuantizationScheme(targets=["Linear"], weights=args)


def w4a16_reference(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, shape: tuple[int, int]
) -> torch.Tensor:
    """compressed-tensors' decompression of one pack-quantized linear, in the scale's dtype."""
    group = shape[1] // scale.shape[-1]
    state = {"weight_packed": packed, "weight_scale": scale, "weight_shape": torch.tensor(shape)}
    if zero is not None:
        state["weight_zero_point"] = zero
    scheme = w4a16_scheme(group, zero is None)
    return PackedQuantizationCompressor.decompress(state, scheme)["weight"]


def nvfp4_reference(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' dequantisation of one nvfp4-pack-quantized linear in fp32 (its decompressor's
    steps with the codes unpacked to fp32 rather than bf16; the decompressor's bf16 is this, rounded)."""
    out, half = packed.shape
    codes = unpack_fp4_from_uint8(packed, out, 2 * half, dtype=torch.float32)
    return dequantize(codes, scale.float(), args=nvfp4_scheme().weights, global_scale=global_scale)


def _weights(out: int, inp: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * 0.05
    w[0, :16] = 0.0  # an all-zero group: the zero-scale guard
    w[1, 5] = 3.0  # an outlier
    return w.to(dtype)


def test_int32_packing_is_compressed_tensors() -> None:
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-8, 8, (24, 64), generator=g, dtype=torch.int8)
    assert torch.equal(pack_int32(codes), pack_to_int32(codes, 4))
    assert torch.equal(unpack_int32(pack_int32(codes)), codes)
    assert torch.equal(pack_int32_rows(codes), pack_to_int32(codes, 4, packed_dim=0))
    assert torch.equal(unpack_int32_rows(pack_int32_rows(codes), 24), codes)
    assert torch.equal(unpack_int32(pack_int32(codes)), unpack_from_int32(pack_int32(codes), 4, codes.shape))
    # the bytes of a word are Spillway's nibble order (little-endian)
    assert torch.equal(pack_int32(codes).view(torch.uint8), pack_nibbles((codes + 8).to(torch.uint8)))


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [32, 128])
def test_w4a16_quantized_as_compressed_tensors(symmetric: bool, dtype: torch.dtype, group: int) -> None:
    """The observer's min/max -> compressed-tensors' qparams and compressor give our bytes."""
    w = _weights(40, 256, 1, dtype)
    packed, scale, zero = quantize_w4a16(w, group, symmetric)
    groups = w.reshape(40, 256 // group, group)
    scheme = w4a16_scheme(group, symmetric)
    ref_scale, ref_zero = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    state = {"weight": w, "weight_scale": ref_scale, "weight_zero_point": ref_zero}
    ref = PackedQuantizationCompressor.compress(state, scheme)
    assert scale.dtype == dtype and torch.equal(scale, ref_scale)
    assert torch.equal(packed, ref["weight_packed"])
    if symmetric:
        assert zero is None and "weight_zero_point" not in ref
    else:
        assert torch.equal(zero, ref["weight_zero_point"])


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_w4a16_dequantised_as_compressed_tensors(symmetric: bool) -> None:
    """fp32 bit for bit (compressed-tensors run on fp32 scales: its product is then exact); in the scale's
    dtype, compressed-tensors' own output."""
    w = _weights(64, 128, 2)
    packed, scale, zero = quantize_w4a16(w, 32, symmetric)
    ours = dequantize_w4a16(packed, scale, zero, torch.float32)
    assert torch.equal(ours, w4a16_reference(packed, scale.float(), zero, (64, 128)))
    assert torch.equal(
        dequantize_w4a16(packed, scale, zero, torch.bfloat16), w4a16_reference(packed, scale, zero, (64, 128))
    )
    rel = (ours - w.float()).norm() / w.float().norm()
    assert rel < 0.13


def test_e2m1_rounding_is_compressed_tensors() -> None:
    grid = torch.arange(-6.5, 6.5, 0.125)
    x = torch.cat([grid, torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.1, -0.0, 0.0])])
    x = x[: len(x) // 2 * 2].clamp(-6, 6).reshape(1, -1)
    expected = pack_fp4_to_uint8(cast_to_fp4(x.clone()))
    assert torch.equal(pack_nibbles(e2m1_round(x)), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nvfp4_quantized_as_compressed_tensors(dtype: torch.dtype) -> None:
    w = _weights(32, 64, 3, dtype)
    packed, scale, global_scale = quantize_ct_nvfp4(w)
    blocks = w.reshape(32, 4, 16)
    amax = w.abs().amax()
    ref_global = generate_gparam(-amax.reshape(1), amax.reshape(1))
    scheme = nvfp4_scheme()
    ref_scale, _ = calculate_qparams(
        blocks.amin(-1), blocks.amax(-1), scheme.weights, global_scale=ref_global
    )
    state = {"weight": w, "weight_scale": ref_scale, "weight_global_scale": ref_global}
    ref = NVFP4PackedCompressor.compress(state, scheme)
    assert torch.equal(global_scale, ref_global) and global_scale.dtype == torch.float32
    assert torch.equal(scale.view(torch.uint8), ref["weight_scale"].view(torch.uint8))
    assert torch.equal(packed, ref["weight_packed"])


def test_nvfp4_dequantised_as_compressed_tensors() -> None:
    w = _weights(32, 64, 4)
    packed, scale, global_scale = quantize_ct_nvfp4(w)
    ours = dequantize_ct_nvfp4(packed, scale, global_scale, torch.float32)
    assert torch.equal(ours, nvfp4_reference(packed, scale, global_scale))
    state = {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": global_scale}
    bf16 = NVFP4PackedCompressor.decompress(state, nvfp4_scheme())["weight"]
    assert torch.equal(dequantize_ct_nvfp4(packed, scale, global_scale, torch.bfloat16), bf16)


def test_global_scale_is_modelopts_reciprocal() -> None:
    """compressed-tensors' global scale is 1 / ModelOpt's weight_scale_2 (448 · 6 / amax), up to its
    rounding in the weights' dtype."""
    amax = torch.tensor(0.75, dtype=torch.bfloat16)
    assert torch.equal(ct_nvfp4_global_scale(amax), torch.tensor([448 * 6 / 0.75]).bfloat16().float())
