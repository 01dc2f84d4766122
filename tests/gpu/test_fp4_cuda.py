"""NVFP4 and MXFP4 checkpoints on the GPU: the experts served from the pinned host store of their published
bits through caches of a few slots to all of them, and prefill streaming whole layers, give the tokens of the
all-resident model (their torch path: no FP4 kernels yet)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.model.synthetic.checkpoint import make_model
from common.protocol import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("quantize", ["nvfp4", "mxfp4"])
def test_offloaded_fp4_matches_resident_on_cuda(tmp_path: Path, quantize: str) -> None:
    path = make_model(tmp_path / quantize, preset="tiny", seed=1, quantize=quantize)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (6, 23, 15)]
    resident = Engine(WorkerConfig(str(path), device="cuda"))
    reference = [r.token_ids for r in resident.generate(prompts, GREEDY)]
    del resident
    for capacity in ["3", "all"]:
        for chunk in [5, 8192]:  # 8192: whole prompts, whole layers streamed
            config = WorkerConfig(
                str(path), device="cuda", max_running=2, expert_cache=capacity, prefill_chunk=chunk
            )
            engine = Engine(config)
            assert engine.offload.fmt.name == quantize and engine.offload.store.mapped
            out = [r.token_ids for r in engine.generate(prompts, GREEDY)]
            engine.offload.tables.check()
            assert out == reference, (capacity, chunk)
