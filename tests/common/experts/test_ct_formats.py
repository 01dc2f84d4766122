"""The compressed-tensors expert formats: registered, their components and bytes, packing as
compressed-tensors packs each linear, and dequantising bit for bit as it does."""

from __future__ import annotations

import pytest
import torch

from common.experts.formats import PUBLISHED_FORMATS, get_format, quantization_error
from common.model.ct_experts import CT_EXPERT_FORMATS
from tests.common.model.test_ct_blocks import nvfp4_reference, w4a16_reference

H, INTER, N = 256, 128, 3
NAMES = ["ct-w4a16", "ct-w4a16-asym", "ct-w4a16-g32", "ct-w4a16-asym-g64-fp16", "ct-nvfp4", "ct-nvfp4a16"]


def _expert(seed: int, std: float = 0.02) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2 * INTER, H, generator=g) * std, torch.randn(H, INTER, generator=g) * std


def test_every_format_registered() -> None:
    assert set(CT_EXPERT_FORMATS) <= set(PUBLISHED_FORMATS)
    for name in CT_EXPERT_FORMATS:
        assert get_format(name).name == name


def test_components_and_bytes() -> None:
    comps = get_format("ct-w4a16-asym").components(H, INTER)
    assert comps == {
        "gate_up_weight_packed": ((2 * INTER, H // 8), torch.int32),
        "gate_up_weight_scale": ((2 * INTER, H // 128), torch.bfloat16),
        "gate_up_weight_zero_point": ((2 * INTER // 8, H // 128), torch.int32),
        "down_weight_packed": ((H, INTER // 8), torch.int32),
        "down_weight_scale": ((H, INTER // 128), torch.bfloat16),
        "down_weight_zero_point": ((H // 8, INTER // 128), torch.int32),
    }
    weights = 3 * H * INTER
    assert get_format("ct-w4a16").expert_nbytes(H, INTER) == weights // 2 + 2 * weights // 128
    nvfp4 = get_format("ct-nvfp4").components(H, INTER)
    assert nvfp4["gate_up_weight_global_scale"] == ((2,), torch.float32)
    assert nvfp4["down_input_global_scale"] == ((1,), torch.float32)
    assert "gate_up_input_global_scale" not in get_format("ct-nvfp4a16").components(H, INTER)
    assert get_format("ct-nvfp4").expert_nbytes(H, INTER) == weights // 2 + weights // 16 + 4 * 6


@pytest.mark.parametrize("name", ["ct-w4a16", "ct-w4a16-g64"])
def test_dims_checked(name: str) -> None:
    with pytest.raises(ValueError, match="multiples"):
        get_format(name).components(H, 96)


@pytest.mark.parametrize("name", NAMES)
def test_pack_gives_the_components(name: str) -> None:
    fmt = get_format(name)
    parts = fmt.pack(*_expert(0))
    assert {k: (tuple(v.shape), v.dtype) for k, v in parts.items()} == fmt.components(H, INTER)
    again = fmt.pack(*_expert(0))
    assert all(torch.equal(parts[k].view(torch.uint8), again[k].view(torch.uint8)) for k in parts)


@pytest.mark.parametrize("std", [0.02, 1.0])
@pytest.mark.parametrize("name", NAMES)
def test_error_within_bound(name: str, std: float) -> None:
    fmt = get_format(name)
    errors = quantization_error(fmt, *_expert(1, std))
    assert max(errors.values()) < fmt.error_bound(), errors


def _linears(name: str, parts: dict[str, torch.Tensor], key: str) -> list[torch.Tensor]:
    """compressed-tensors' dequantisation (fp32) of the expert's stored linears under `key`."""
    rows = 2 * INTER if key == "gate_up" else H
    inp = H if key == "gate_up" else INTER
    linears = 2 if key == "gate_up" else 1
    out = []
    for n in range(linears):
        lo, hi = n * rows // linears, (n + 1) * rows // linears
        if name.startswith("ct-nvfp4"):
            glob = parts[f"{key}_weight_global_scale"][n : n + 1]
            out.append(
                nvfp4_reference(
                    parts[f"{key}_weight_packed"][lo:hi], parts[f"{key}_weight_scale"][lo:hi], glob
                )
            )
            continue
        zero = parts.get(f"{key}_weight_zero_point")
        zero = None if zero is None else zero[lo // 8 : hi // 8]
        scale = parts[f"{key}_weight_scale"][lo:hi].float()
        out.append(w4a16_reference(parts[f"{key}_weight_packed"][lo:hi], scale, zero, (hi - lo, inp)))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_unpack_many_is_compressed_tensors(name: str) -> None:
    """N experts dequantise (fp32) bit for bit as compressed-tensors dequantises each stored linear."""
    fmt = get_format(name)
    experts = [fmt.pack(*_expert(10 + e)) for e in range(N)]
    stacked = {k: torch.stack([p[k] for p in experts]) for k in experts[0]}
    gate_up, down = fmt.unpack_many(stacked, torch.float32)
    assert gate_up.shape == (N, 2 * INTER, H) and down.shape == (N, H, INTER)
    for e, parts in enumerate(experts):
        assert torch.equal(gate_up[e], torch.cat(_linears(name, parts, "gate_up")))
        assert torch.equal(down[e], _linears(name, parts, "down")[0])
