"""The dense decode MoE kernels (common/kernels/moe_dense.py: bf16, fp8, the 4-bit floats, the published
int4 formats) in Triton's interpreter (compiled on CUDA) against the format's dequantise-then-multiply, at
widths that leave partial blocks and fp8 scale blocks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from common.experts.formats import ExpertFormat, get_format
from common.model.int4_blocks import join_pieces, quantize_gptq

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


FLOATS = ["bf16", "fp8", "nvfp4", "mxfp4", "ct-nvfp4"]
INT4 = ["gptq", "gptq_v2", "awq", "ct-w4a16", "ct-w4a16-asym-fp16"]
"""Int4 formats at groups of 128 (g32 at the narrow widths)."""
WIDTHS = [(256, 128, 16), (224, 96, 32)]


def _narrow(name: str) -> str:
    """The format at groups of 32 (224 and 96 are no multiples of 128)."""
    if name.startswith("ct-w4a16"):
        return name.replace("ct-w4a16", "ct-w4a16-g32").replace("-g32-asym", "-asym-g32")
    return f"{name}-g32"


CASES = [(f, *w) for f in FLOATS for w in WIDTHS] + [
    (f if hidden == 256 else _narrow(f), hidden, inter, block)
    for f in INT4
    for hidden, inter, block in WIDTHS
]


@pytest.mark.parametrize(("fmt_name", "hidden", "inter", "block"), CASES)
def test_dense_decode_matches_the_dequantised_reference(fmt_name: str, hidden: int, inter: int, block: int):
    """Also at widths that leave partial blocks (224, 96: not multiples of 128)."""
    fmt, gen = get_format(fmt_name), torch.Generator().manual_seed(hidden)
    packed = [
        fmt.pack(
            torch.randn(2 * inter, hidden, generator=gen) * 0.05,
            torch.randn(hidden, inter, generator=gen) * 0.05,
        )
        for _ in range(5)
    ]
    _check_against_reference(fmt, packed, hidden, block, int(fmt_name.split("-")[0] == "gptq"), gen)


@pytest.mark.parametrize("method", ["gptq", "gptq_v2"])
def test_gptq_with_desc_act_reads_each_input_s_group(method: str):
    """GPTQ with `desc_act`: each linear's inputs fill the groups in its own permuted order (g_idx), with
    asymmetric zeros."""
    hidden, inter, group = 128, 64, 32
    fmt, gen = get_format(f"{method}-g{group}"), torch.Generator().manual_seed(7)
    packed = []
    for _ in range(5):
        parts: dict[str, torch.Tensor] = {}
        for part, shapes in (("gate_up", [(inter, hidden)] * 2), ("down", [(hidden, inter)])):
            linears = [
                quantize_gptq(
                    torch.randn(*shape, generator=gen) * 0.05, group, sym=False,
                    perm=torch.randperm(shape[1], generator=gen), v2=method == "gptq_v2",
                )
                for shape in shapes
            ]  # fmt: skip
            parts |= {f"{part}_{n}": join_pieces(n, [lin[n] for lin in linears]) for n in linears[0]}
        packed.append(parts)
    _check_against_reference(fmt, packed, hidden, 16, int(method == "gptq"), gen)


def _check_against_reference(
    fmt: ExpertFormat, packed: list[dict[str, torch.Tensor]], hidden: int, block: int, param: int,
    gen: torch.Generator, mixing: Any = None,
) -> None:  # fmt: skip
    """Two tokens' three choices over a pool of the packed experts (a row twice in one token): the kernels
    against the format's dequantise-then-multiply in fp32."""
    from common.kernels.moe_dense import moe_dense_decode

    pool = {name: torch.stack([p[name] for p in packed]).to(DEVICE) for name in packed[0]}
    x = torch.randn(2, hidden, generator=gen).to(DEVICE)
    rows = torch.tensor([[1, 3, 3], [0, 4, 2]], device=DEVICE)
    weights = torch.softmax(torch.randn(2, 3, generator=gen), -1).to(DEVICE)
    calls = []
    out = moe_dense_decode(
        x, rows, weights, pool, block=block, before_down=lambda: calls.append(1), param=param, mixing=mixing
    )
    gate_up, down = fmt.unpack_many({n: t[rows.reshape(-1)] for n, t in pool.items()}, torch.float32)
    h = torch.einsum("ph,pnh->pn", x.float().repeat_interleave(3, dim=0), gate_up)
    gate, up = h.chunk(2, dim=-1)
    y = torch.einsum("pi,phi->ph", F.silu(gate) * up, down) * weights.reshape(-1, 1)
    torch.testing.assert_close(out.float(), y.view(2, 3, -1).sum(1), rtol=1e-4, atol=1e-4)
    assert calls == [1]


@pytest.mark.parametrize("fmt_name", ["trellis2", "trellis3.5", "trellis4-l12"])
def test_trellis_decode_matches_the_dequantised_reference(fmt_name: str) -> None:
    """Trellis codes decoded in registers (any bytes are codes: random ones, no encoder run), the inputs and
    outputs taken through the format's rotations (`kernel_mixing`)."""
    hidden, inter = 256, 128
    fmt, gen = get_format(fmt_name), torch.Generator().manual_seed(3)
    comps = fmt.components(hidden, inter)
    packed = []
    for _ in range(5):
        parts = {}
        for name, (shape, dtype) in comps.items():
            if dtype == torch.uint8:
                parts[name] = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
            else:
                parts[name] = (0.03 + 0.04 * torch.rand(shape, generator=gen)).to(dtype)
        packed.append(parts)
    _check_against_reference(fmt, packed, hidden, 16, fmt.kernel_param, gen, mixing=fmt.kernel_mixing())


def test_the_kernels_codebook_is_the_formats() -> None:
    from common.kernels import moe_dense
    from common.model import trellis_blocks

    kernel = ((moe_dense.MUL0.value, moe_dense.ADD0.value), (moe_dense.MUL1.value, moe_dense.ADD1.value))
    assert kernel == trellis_blocks._HASH
    assert moe_dense.IRWIN_HALL_STD.value == pytest.approx(trellis_blocks._IRWIN_HALL_STD, rel=1e-12)
