"""The bf16 / fp8 / NVFP4 / MXFP4 decode MoE kernels (common/kernels/moe_dense.py) in Triton's interpreter
(compiled on CUDA) against the format's dequantise-then-multiply, at widths that leave partial blocks and
fp8 scale blocks."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.experts.formats import get_format
from common.kernels.config import KERNELS
from common.model.synthetic.checkpoint import make_model
from common.protocol import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("fmt_name", ["bf16", "fp8", "nvfp4", "mxfp4"])
@pytest.mark.parametrize(("hidden", "inter", "block"), [(256, 128, 16), (224, 96, 32)])
def test_dense_decode_matches_the_dequantised_reference(fmt_name: str, hidden: int, inter: int, block: int):
    """bf16 / fp8 also at widths that leave partial blocks (224, 96: not multiples of 128)."""
    from common.kernels.moe_dense import moe_dense_decode

    fmt, gen = get_format(fmt_name), torch.Generator().manual_seed(hidden)
    packed = [
        fmt.pack(
            torch.randn(2 * inter, hidden, generator=gen) * 0.05,
            torch.randn(hidden, inter, generator=gen) * 0.05,
        )
        for _ in range(5)
    ]
    pool = {name: torch.stack([p[name] for p in packed]).to(DEVICE) for name in packed[0]}
    x = torch.randn(2, hidden, generator=gen).to(DEVICE)
    rows = torch.tensor([[1, 3, 3], [0, 4, 2]], device=DEVICE)  # a row twice in one token
    weights = torch.softmax(torch.randn(2, 3, generator=gen), -1).to(DEVICE)
    calls = []
    out = moe_dense_decode(x, rows, weights, pool, block=block, before_down=lambda: calls.append(1))
    gate_up, down = fmt.unpack_many({n: t[rows.reshape(-1)] for n, t in pool.items()}, torch.float32)
    h = torch.einsum("ph,pnh->pn", x.float().repeat_interleave(3, dim=0), gate_up)
    gate, up = h.chunk(2, dim=-1)
    y = torch.einsum("pi,phi->ph", F.silu(gate) * up, down) * weights.reshape(-1, 1)
    torch.testing.assert_close(out.float(), y.view(2, 3, -1).sum(1), rtol=1e-4, atol=1e-4)
    assert calls == [1]


@pytest.mark.parametrize("fmt_name", ["bf16", "fp8", "nvfp4", "mxfp4"])
def test_offloaded_decode_through_the_dense_kernels(tmp_path: Path, fmt_name: str) -> None:
    """An offloaded model's decode passes through the kernels (recorded as CUDA graphs on CUDA, with the
    copies in two stages) give the torch path's greedy tokens (NVFP4 / MXFP4: a checkpoint published so,
    its experts in their bits)."""
    published = fmt_name in ("nvfp4", "mxfp4")
    path = make_model(
        tmp_path / "m", preset="tiny", arch="qwen3_moe", quantize=fmt_name if published else None
    )
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = []
    for fused in (False, True):
        engine = Engine(
            WorkerConfig(
                str(path),
                device=DEVICE,
                max_running=2,
                expert_cache="0.25",
                expert_format="bf16" if published else fmt_name,
                cuda_graphs=DEVICE == "cuda",
                kernels=replace(KERNELS, moe_dense=fused),
            )
        )
        assert engine.offload.dense_kernels
        tokens.append([r.token_ids for r in engine.generate(prompts, params)])
        engine.offload.tables.check()
    assert tokens[0] == tokens[1]
