"""A tiny qwen4_exp model with every opt-in fused kernel on (hyper-connections, the Gated DeltaNet step in
three kernels, the cache resolution) against the same model in torch: close logits at every step
of a prefill and a greedy decode with offloaded experts (past the QSA budget, so the indexer's selection
matters in the prefill and in every decode step), the same tokens, the same cache traffic (routing is
replayed)."""

from __future__ import annotations

from pathlib import Path

import torch

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.model.synthetic.checkpoint import make_model
from common.protocol import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _engine(path: Path, fused: bool) -> Engine:
    engine = Engine(
        WorkerConfig(
            str(path),
            device=DEVICE,
            max_running=2,
            expert_cache="0.5",
            cuda_graphs=False,
            replay_routing="synthetic-zipf:seed=5",
            fused_kernels=fused,
        )
    )
    assert engine.offload.fused_resolve == fused and engine.runner.backend.fused_decode == fused
    return engine


def test_fused_kernels_keep_the_model(tmp_path: Path) -> None:
    sparse = {"indexer_budget": 8, "indexer_compress_ratio": 4}  # 11 keys at most: past it QSA selects
    path = make_model(tmp_path / "m", preset="tiny", arch="qwen4_exp", overrides=sparse)
    torch_engine, fused_engine = _engine(path, False), _engine(path, True)
    prompt = torch.randint(3, 1000, (23,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = []
    for engine in (torch_engine, fused_engine):
        seq = engine.runner.new_sequence()
        steps = [engine.runner.forward([seq], [prompt])]
        for _ in range(6):
            steps.append(engine.runner.forward([seq], [[int(steps[-1].argmax(-1))]]))
        logits.append(torch.cat(steps))
        engine.runner.release(seq)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [prompt, prompt[:5]]
    assert [r.token_ids for r in fused_engine.generate(prompts, params)] == [
        r.token_ids for r in torch_engine.generate(prompts, params)
    ]
    for name, counts in fused_engine.offload.tables.counters.items():
        assert torch.equal(counts, torch_engine.offload.tables.counters[name]), name
