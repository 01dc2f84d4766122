"""An offloaded model's decode through the in-place dense kernels (common/kernels/moe_dense.py, recorded as
CUDA graphs, the copies in two stages) against torch's gather path: the same greedy tokens."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.kernels.config import KERNELS
from common.model.synthetic.checkpoint import make_model
from common.protocol import SamplingParams

PUBLISHED = ("nvfp4", "mxfp4", "gptq", "gptq-desc-act", "awq", "w4a16", "w4a16-asym", "nvfp4a16")
"""make-model's quantized variants whose experts the host store keeps in their published bits."""


@pytest.mark.parametrize("fmt_name", ["bf16", "fp8", *PUBLISHED])
def test_offloaded_decode_through_the_dense_kernels(tmp_path: Path, fmt_name: str) -> None:
    """An offloaded model's decode passes through the kernels (recorded as CUDA graphs on CUDA, with the
    copies in two stages) give the torch path's greedy tokens (the published variants: a checkpoint
    published so, its experts in their bits)."""
    published = fmt_name in PUBLISHED
    path = make_model(
        tmp_path / "m", preset="tiny", arch="qwen3_moe", quantize=fmt_name if published else None
    )
    _same_tokens_both_ways(path, "bf16" if published else fmt_name)


def test_trellis_decode_through_the_dense_kernels(tmp_path: Path) -> None:
    """Trellis-coded experts (packed at load, on the GPU): the kernels' greedy tokens are the torch path's."""
    shape = {"hidden_size": 128, "moe_intermediate_size": 128, "intermediate_size": 256}
    path = make_model(tmp_path / "m", preset="tiny", arch="qwen3_moe", overrides=shape)
    _same_tokens_both_ways(path, "trellis3")


def _same_tokens_both_ways(path: Path, expert_format: str) -> None:
    """Greedy tokens of two prompts with `KernelConfig.moe_dense` off, then on: equal."""
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = []
    for fused in (False, True):
        engine = Engine(
            WorkerConfig(
                str(path), device="cuda", max_running=2, expert_cache="0.25", expert_format=expert_format,
                cuda_graphs=True, kernels=replace(KERNELS, moe_dense=fused),
            )
        )  # fmt: skip
        assert engine.offload.dense_kernels and engine.offload.kernels.moe_dense == fused
        tokens.append([r.token_ids for r in engine.generate(prompts, params)])
        engine.offload.tables.check()
    assert tokens[0] == tokens[1]
