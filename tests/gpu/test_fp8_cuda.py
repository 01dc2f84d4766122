"""fp8 resident projections on the GPU (bf16 model, fused kernels, recorded decode passes): the fp8 kernel
runs inside the recorded steps, prefill dequantises, and the logits stay within fp8's rounding of the bf16
model's; recorded and op-by-op passes give the same tokens."""

from __future__ import annotations

from pathlib import Path

import torch

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.model.fp8_linear import Fp8Fused
from common.model.synthetic.checkpoint import make_model
from common.protocol import SamplingParams
from tests.common.model.test_fp8_linear import teacher_forced

SPARSE = {"indexer_budget": 8, "indexer_compress_ratio": 4}  # prefill and decode past QSA's budget


def test_fp8_mixers_on_cuda_with_graphs(tmp_path: Path) -> None:
    path = make_model(tmp_path / "q4", preset="tiny", arch="qwen4_exp", overrides=SPARSE)
    prompt = torch.randint(3, 1000, (29,), generator=torch.Generator().manual_seed(0)).tolist()
    make = lambda resident, graphs: Engine(
        WorkerConfig(
            str(path),
            dtype="bfloat16",
            device="cuda",
            max_running=2,
            resident_dtype=resident,
            cuda_graphs=graphs,
        )
    )
    bf16, fp8 = make(None, True), make("fp8", True)
    assert any(isinstance(getattr(m, "fused_in", None), Fp8Fused) for m in fp8.model.modules())
    ref = teacher_forced(bf16, prompt, 6, None)
    got = torch.cat(teacher_forced(fp8, prompt, 6, [int(r.argmax(-1)) for r in ref[:-1]]))
    ref = torch.cat(ref)
    assert (got - ref).norm() <= 0.08 * ref.norm()  # fp8 weights and bf16 activations
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    eager = make("fp8", False)
    prompts = [prompt, prompt[:7]]
    assert [r.token_ids for r in fp8.generate(prompts, params)] == [
        r.token_ids for r in eager.generate(prompts, params)
    ]
