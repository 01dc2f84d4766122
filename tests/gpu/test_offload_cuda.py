"""The expert cache and arena with CUDA tensors and the real pinned, mapped host store: same tokens as the
all-resident model on the GPU for every capacity and policy."""

from __future__ import annotations

from pathlib import Path

import torch

from common.engine import Engine
from common.model.synthetic import make_model
from common.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_offloaded_experts_on_cuda(tmp_path: Path) -> None:
    path = make_model(tmp_path / "m", preset="tiny", arch="qwen3_moe")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (6, 23, 15)]
    reference = [
        r.token_ids for r in Engine(path, dtype=torch.float32, device="cuda").generate(prompts, GREEDY)
    ]
    for capacity in ["3", "0.25", "all"]:
        for policy in ["lru", "lfu", "lfu-admit"]:
            engine = Engine(
                path,
                dtype=torch.float32,
                device="cuda",
                max_seqs=2,
                expert_cache=capacity,
                cache_policy=policy,
                prefill_chunk=5,
            )
            assert engine.offload.store.mapped and engine.offload.tables.slot_of.is_cuda
            out = [r.token_ids for r in engine.generate(prompts, GREEDY)]
            engine.offload.tables.check()
            assert out == reference, (capacity, policy)
