"""The grouped dense prefill kernels (common/kernels/moe_dense_grouped.py) in Triton's interpreter (compiled
on CUDA) against each format's dequantise-then-multiply: experts used by many tokens, by one, by none, at
widths that leave partial tiles; and a model whose published experts are offloaded, prefilled through the
kernels, against the same model through the torch path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.experts.formats import get_format
from common.kernels.moe_int4_grouped import GroupedConfig
from common.model.fused_kernels import use_fused_kernels
from common.model.synthetic.checkpoint import make_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter has no bf16 matmul: fp32 without CUDA; bf16 on the GPU, as prefill runs
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
TOLERANCE = 2e-2 if DEVICE == "cuda" else 1e-5
CASES = [
    ("bf16", 256, 128), ("fp8", 224, 96), ("nvfp4", 256, 128), ("mxfp4", 224, 96), ("ct-nvfp4a16", 256, 96),
    ("gptq", 256, 128), ("gptq_v2-g32", 224, 96), ("awq-g32", 224, 96), ("ct-w4a16", 256, 128),
    ("ct-w4a16-asym-g32-fp16", 224, 96),
]  # fmt: skip


@pytest.mark.parametrize(("fmt_name", "hidden", "inter"), CASES)
def test_grouped_dense_matches_dequantised_reference(fmt_name: str, hidden: int, inter: int) -> None:
    """Blocks of 16 pairs, 32 columns a program, down in slices of at most 8 tokens; 224 and 96 leave
    partial tiles of 128 inputs and 32 columns."""
    from common.kernels.moe_dense_grouped import moe_dense_grouped

    fmt, gen = get_format(fmt_name), torch.Generator().manual_seed(hidden + inter)
    weight = lambda *shape: torch.randn(*shape, generator=gen) * 0.05
    packed = [fmt.pack(weight(2 * inter, hidden), weight(hidden, inter)) for _ in range(8)]
    pool = {name: torch.stack([p[name] for p in packed]).to(DEVICE) for name in packed[0]}
    tokens, k, experts = 21, 3, 6
    rows = torch.randperm(8, generator=gen)[:experts].to(DEVICE)  # expert e at pool row rows[e]
    ids = torch.stack([torch.randperm(experts - 1, generator=gen)[:k] for _ in range(tokens)])  # 5 unused
    ids[: tokens // 2, 0] = 0  # a hot expert
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), -1)
    x = torch.randn(tokens, hidden, generator=gen)
    zero_offset = int(fmt_name.split("-")[0] == "gptq")  # v1 stores zero − 1
    out = moe_dense_grouped(
        x.to(DEVICE, DTYPE), ids.to(DEVICE), weights.to(DEVICE), rows, pool,
        GroupedConfig(16, 32, 4, 1), down_tokens=8, param=zero_offset,
    )  # fmt: skip

    chosen = {n: t[rows[ids.reshape(-1).to(DEVICE)]].cpu() for n, t in pool.items()}
    gate_up, down = fmt.unpack_many(chosen, torch.float32)
    h = torch.einsum("ph,pnh->pn", x.to(DTYPE).float().repeat_interleave(k, 0), gate_up)
    gate, up = h.chunk(2, dim=-1)
    want = (torch.einsum("pi,phi->ph", F.silu(gate) * up, down) * weights.reshape(-1, 1)).view(tokens, k, -1)
    assert (out.float().cpu() - want.sum(1)).norm() <= TOLERANCE * want.sum(1).norm()


@pytest.mark.skipif(DEVICE == "cpu", reason="the dense kernels are the CUDA path (dense_kernels)")
@pytest.mark.parametrize("quantize", ["nvfp4", "gptq"])
def test_offloaded_published_prefill_through_the_kernels(tmp_path: Path, quantize: str) -> None:
    path = make_model(tmp_path / "m", preset="tiny", arch="qwen3_moe", quantize=quantize)
    prompt = torch.randint(3, 1000, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = []
    for fused in (False, True):
        engine = Engine(
            WorkerConfig(
                str(path), dtype="bfloat16", device=DEVICE, max_running=1, expert_cache="0.5",
                expert_format="bf16", cuda_graphs=False,
            )
        )  # fmt: skip
        use_fused_kernels(engine.model, fused)
        assert engine.offload.fused_dense_prefill == fused
        logits.append(engine.runner.forward([engine.runner.new_sequence()], [prompt]).float())
    assert (logits[1] - logits[0]).norm() <= TOLERANCE * logits[0].norm()
