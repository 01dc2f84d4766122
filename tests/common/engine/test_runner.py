"""ModelRunner: the worker warm-up (only on CUDA, a failure logged rather than raised) and layer-major
prefill against chunked passes."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.engine.runner import warm_up_on_cuda
from common.model.synthetic.checkpoint import make_model


def test_warm_up_on_cuda_logs_a_failure_and_skips_other_devices(caplog) -> None:
    calls = []

    def fails() -> None:
        calls.append(1)
        raise RuntimeError("out of memory")

    warm_up_on_cuda(SimpleNamespace(device=torch.device("cpu"), warm_up=fails))
    assert not calls  # nothing to compile on the CPU
    with caplog.at_level(logging.WARNING, logger="common.engine.runner"):
        warm_up_on_cuda(SimpleNamespace(device=torch.device("cuda"), warm_up=fails))
    assert calls and "warm-up failed" in caplog.text


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen4_exp"])
@pytest.mark.parametrize("cache", [None, "0.5"], ids=["resident", "offloaded"])
def test_layer_major_prefill_is_chunked_prefill(tmp_path: Path, arch: str, cache: str | None) -> None:
    """A prompt in chunks of 16 (T·k = 32 ≥ 4·E: whole layers streamed), layer by layer, against the same
    chunks as passes: the same logits and the same tokens after; offloaded, each layer streamed once (the
    MoE runs once over all the chunks' tokens) instead of once a chunk (the last chunk as a pass, 7
    tokens, is small: it reads the cache and tops up)."""
    overrides = {"indexer_budget": 8, "indexer_compress_ratio": 4} if arch == "qwen4_exp" else {}
    path = make_model(tmp_path / "m", preset="tiny", arch=arch, overrides=overrides)
    prompt = torch.randint(3, 1000, (55,), generator=torch.Generator().manual_seed(0)).tolist()
    results = []
    for layer_major in (False, True):
        engine = Engine(WorkerConfig(str(path), max_running=1, expert_cache=cache))
        runner, seq = engine.runner, engine.runner.new_sequence()
        before = engine.offload.traffic() if cache else None
        if layer_major:
            logits = runner.prefill_layer_major(seq, prompt, 16)
        else:
            for at in range(0, len(prompt), 16):
                logits = runner.forward([seq], [prompt[at : at + 16]])
        loads = None
        if cache:
            after = engine.offload.traffic()
            loads = [a - b for a, b in zip(after.arena_loads, before.arena_loads, strict=True)]
        tokens = [int(logits.argmax(-1))]
        for _ in range(5):
            tokens.append(int(runner.forward([seq], [[tokens[-1]]]).argmax(-1)))
        results.append((logits, tokens, loads))
    (chunked, chunked_tokens, chunked_loads), (layered, layered_tokens, layered_loads) = results
    torch.testing.assert_close(layered, chunked, rtol=1e-5, atol=1e-5)
    assert layered_tokens == chunked_tokens
    if cache:
        # per MoE layer: three streams (one a big chunk) and the small chunk's top-up, against one
        assert chunked_loads == [4] * len(chunked_loads) and layered_loads == [1] * len(layered_loads)
