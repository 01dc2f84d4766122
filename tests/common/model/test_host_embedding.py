"""Token embeddings in host memory: the same tokens as the model with its embedding on the device, the
memory plan counting no device bytes for it (and more cache slots), a tied head refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.engine.memory_plan import plan_for_dir
from common.model.host_embedding import HostEmbedding
from common.model.synthetic.checkpoint import make_model
from common.protocol import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen4_exp"])
def test_same_tokens_with_embeddings_on_host(tmp_path: Path, arch: str) -> None:
    path = make_model(tmp_path / "m", preset="tiny", arch=arch)
    prompts = [[5, 6, 7, 8, 9], [40, 41]]
    outs = []
    for on_host in (False, True):
        engine = Engine(
            WorkerConfig(str(path), max_running=2, expert_cache="0.5", embeddings_on_host=on_host)
        )
        assert isinstance(engine.model.model.embed_tokens, HostEmbedding) == on_host
        outs.append([r.token_ids for r in engine.generate(prompts, PARAMS)])
    assert outs[0] == outs[1]


def test_plan_gives_the_embedding_bytes_to_the_cache(tmp_path: Path) -> None:
    path = make_model(tmp_path / "m", preset="tiny", arch="qwen3_moe", overrides={"vocab_size": 20000})
    settings = {"expert_format": "bf16", "budget_bytes": 1 << 30, "max_context": 256, "max_running": 2}
    plans = [plan_for_dir(path, dtype=torch.bfloat16, embeddings_on_host=h, **settings) for h in (0, 1)]
    hidden = 64
    assert plans[0].weights - plans[1].weights == 20000 * hidden * 2
    assert plans[1].cache_slots >= plans[0].cache_slots


def test_tied_embeddings_are_refused(tmp_path: Path) -> None:
    path = make_model(
        tmp_path / "m", preset="tiny", arch="qwen3_moe", overrides={"tie_word_embeddings": True}
    )
    with pytest.raises(ValueError, match="ties its embeddings"):
        Engine(WorkerConfig(str(path), max_running=1, embeddings_on_host=True))
