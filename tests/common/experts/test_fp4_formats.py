"""NVFP4 and MXFP4 expert formats: their layouts and bytes an expert, and their dequantisation bit for bit
against a reference written here from the formats' specifications (e2m1, e4m3 and e8m0 decoded from their
bits, not through the formats' tables)."""

from __future__ import annotations

import pytest
import torch

from common.experts.formats import get_format, quantization_error

H, INTER = 64, 96  # tiny: multiples of 32, not of 128


def e2m1_reference(code: int) -> float:
    """OCP MX e2m1: sign, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is subnormal (0 or 0.5)."""
    sign, exponent, mantissa = code >> 3, (code >> 1) & 3, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return -magnitude if sign else magnitude


def e4m3_reference(byte: int) -> float:
    """float8 e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; S.1111.111 is NaN, no infinities."""
    sign, exponent, mantissa = byte >> 7, (byte >> 3) & 15, byte & 7
    if exponent == 15 and mantissa == 7:
        return float("nan")
    magnitude = mantissa / 8 * 2.0**-6 if exponent == 0 else 2.0 ** (exponent - 7) * (1 + mantissa / 8)
    return -magnitude if sign else magnitude


def _codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> values [..., 2n] (fp32): element 2j is byte j's low nibble."""
    table = torch.tensor([e2m1_reference(c) for c in range(16)])
    low, high = table[(packed & 15).long()], table[(packed >> 4).long()]
    return torch.stack((low, high), dim=-1).flatten(-2)


def nvfp4_reference(weight: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """One linear: (e2m1 · e4m3 block scale per 16 inputs) · global scale, in fp32."""
    e4m3 = torch.tensor([e4m3_reference(b) for b in range(256)])
    block = e4m3[scale.view(torch.uint8).long()].repeat_interleave(16, dim=-1)  # [out, in]
    return _codes(weight) * block * scale_2.float()


def mxfp4_reference(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One linear: e2m1 · 2^(e8m0 − 127) per 32 inputs, in fp32."""
    values = _codes(blocks)  # [out, G, 32]
    power = torch.tensor([2.0 ** (b - 127) for b in range(256)])[scales.long()]  # [out, G]
    return (values * power[..., None]).flatten(-2)


def _weights(std: float = 0.05, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2 * INTER, H, generator=g) * std, torch.randn(H, INTER, generator=g) * std


def test_e2m1_table_and_nibble_order() -> None:
    fmt = get_format("mxfp4")
    parts = fmt.pack(*_weights())
    blocks = torch.arange(16, dtype=torch.uint8).repeat(2 * INTER, H // 32, 1)  # byte j holds codes (j, 0)
    parts = {
        **parts,
        "gate_up_blocks": blocks,
        "gate_up_scales": torch.full((2 * INTER, H // 32), 127).byte(),
    }
    gate_up, _ = fmt.unpack(parts, torch.float32)
    want = [e2m1_reference(j) if n == 0 else 0.0 for j in range(16) for n in (0, 1)]
    assert gate_up[0, :32].tolist() == want
    assert [e2m1_reference(c) for c in range(8)] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_layouts_and_bytes() -> None:
    nv = get_format("nvfp4").components(H, INTER)
    assert nv["gate_up_weight"] == ((2 * INTER, H // 2), torch.uint8)
    assert nv["gate_up_weight_scale"] == ((2 * INTER, H // 16), torch.float8_e4m3fn)
    assert nv["gate_up_weight_scale_2"] == ((2,), torch.float32)
    assert nv["down_weight"] == ((H, INTER // 2), torch.uint8)
    mx = get_format("mxfp4").components(H, INTER)
    assert mx["gate_up_blocks"] == ((2 * INTER, H // 32, 16), torch.uint8)
    assert mx["down_scales"] == ((H, INTER // 32), torch.uint8)
    n = 3 * H * INTER  # weights an expert
    assert get_format("nvfp4").expert_nbytes(H, INTER) == n // 2 + n // 16 + 4 * 6
    assert get_format("mxfp4").expert_nbytes(H, INTER) == n // 2 + n // 32


@pytest.mark.parametrize("std", [0.02, 1.0, 1e-6, 1e6])
def test_nvfp4_dequantises_to_the_reference(std: float) -> None:
    fmt = get_format("nvfp4")
    gate_up, down = _weights(std)
    parts = fmt.pack(gate_up, down)
    got_gu, got_d = fmt.unpack(parts, torch.float32)
    gate, up = (
        nvfp4_reference(parts["gate_up_weight"][rows], parts["gate_up_weight_scale"][rows], s)
        for rows, s in zip(
            (slice(0, INTER), slice(INTER, 2 * INTER)), parts["gate_up_weight_scale_2"], strict=True
        )
    )
    assert torch.equal(got_gu, torch.cat([gate, up]))
    ref_d = nvfp4_reference(parts["down_weight"], parts["down_weight_scale"], parts["down_weight_scale_2"])
    assert torch.equal(got_d, ref_d)
    assert max(quantization_error(fmt, gate_up, down).values()) < fmt.error_bound()


@pytest.mark.parametrize("std", [0.02, 1.0, 1e-6, 1e6])
def test_mxfp4_dequantises_to_the_reference(std: float) -> None:
    fmt = get_format("mxfp4")
    gate_up, down = _weights(std)
    parts = fmt.pack(gate_up, down)
    got_gu, got_d = fmt.unpack(parts, torch.float32)
    assert torch.equal(got_gu, mxfp4_reference(parts["gate_up_blocks"], parts["gate_up_scales"]))
    assert torch.equal(got_d, mxfp4_reference(parts["down_blocks"], parts["down_scales"]))
    assert max(quantization_error(fmt, gate_up, down).values()) < fmt.error_bound()


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_unpack_many_and_mlp_agree_with_unpack(name: str) -> None:
    """N experts at once equal one at a time; `mlp` is the SwiGLU of the dequantised weights."""
    fmt = get_format(name)
    packed = [fmt.pack(*_weights(seed=s)) for s in range(3)]
    many = fmt.unpack_many({k: torch.stack([p[k] for p in packed]) for k in packed[0]}, torch.float32)
    for e, parts in enumerate(packed):
        one = fmt.unpack(parts, torch.float32)
        assert torch.equal(many[0][e], one[0]) and torch.equal(many[1][e], one[1])
    x = torch.randn(5, H)
    gate, up = (x @ many[0][0].T).chunk(2, dim=-1)
    ref = (torch.nn.functional.silu(gate) * up) @ many[1][0].T
    torch.testing.assert_close(fmt.mlp(x, packed[0], torch.nn.functional.silu), ref)


@pytest.mark.parametrize(("name", "group"), [("nvfp4", 16), ("mxfp4", 32)])
def test_dims_must_fill_groups(name: str, group: int) -> None:
    with pytest.raises(ValueError, match=str(group)):
        get_format(name).components(H, group + group // 2)


def test_zero_and_saturation() -> None:
    """An all-zero block dequantises to zeros; each block's largest magnitude survives within e2m1's step."""
    fmt = get_format("nvfp4")
    gate_up, down = _weights()
    gate_up[:, :16] = 0
    restored, _ = fmt.unpack(fmt.pack(gate_up, down), torch.float32)
    assert torch.equal(restored[:, :16], torch.zeros(2 * INTER, 16))
    mx = get_format("mxfp4")
    restored, _ = mx.unpack(mx.pack(gate_up, down), torch.float32)
    top = gate_up[:, 32:64].abs().amax(dim=-1)
    assert torch.all((restored[:, 32:64].abs().amax(dim=-1) - top).abs() <= top / 4)
