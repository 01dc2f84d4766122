"""QSA's decode prologue (common/kernels/qsa_prologue.py): the indexer's key compression and the three norms
and rotations as programs of one kernel give what the four kernels give one after another, bit for bit (the
same bodies), in a tiny qwen4_exp decoding past the indexer's budget: the same logits, the same keys, values
and block keys in the pages."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.kernels.config import KERNELS, KernelConfig
from common.model.qwen4_exp.qsa import QSAttention
from common.model.synthetic.checkpoint import make_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _decode(
    path: Path, prompt: list[int], kernels: KernelConfig = KERNELS
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Logits of a prefill and four decode steps, and the QSA layers' pages after them."""
    engine = Engine(
        WorkerConfig(
            str(path), device=DEVICE, max_running=1, cuda_graphs=False, fused_kernels=True, kernels=kernels
        )
    )
    seq = engine.runner.new_sequence()
    logits = [engine.runner.forward([seq], [prompt])]
    for _ in range(4):
        logits.append(engine.runner.forward([seq], [[int(logits[-1][-1].argmax())]]))
    pages = []
    for i, layer in enumerate(engine.model.model.layers):
        if isinstance(getattr(layer, "self_attn", None), QSAttention):
            paged = engine.runner.pool.layer(i).paged
            pages += [paged[name].clone() for name in ("k", "v", "index_k", "index_block")]
    return logits, pages


def test_prologue_decodes_as_the_four_kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from common.kernels import qsa_prologue

    sparse = {"indexer_budget": 8, "indexer_compress_ratio": 4}  # 11 keys at most: past it QSA selects
    path = make_model(tmp_path / "m", preset="tiny", arch="qwen4_exp", overrides=sparse)
    prompt = torch.randint(3, 1000, (21,), generator=torch.Generator().manual_seed(2)).tolist()
    launches = []
    plain = qsa_prologue.qsa_prologue
    monkeypatch.setattr(qsa_prologue, "qsa_prologue", lambda *a, **kw: launches.append(1) or plain(*a, **kw))
    fused = _decode(path, prompt)
    assert launches  # every decode step's QSA layers
    launches.clear()
    apart = _decode(path, prompt, replace(KERNELS, prologue_kernel=False))
    assert not launches
    for got, want in zip([*fused[0], *fused[1]], [*apart[0], *apart[1]], strict=True):
        assert torch.equal(got, want)


def test_decode_after_images_rotates_at_the_delta(tmp_path: Path) -> None:
    """After a prompt with an image, the kernels rotate decode's queries, keys and block keys at position +
    delta (`ForwardBatch.rope_positions`), as the torch path does; a prompt pass with image tokens takes the
    torch rotation (three positions a token)."""
    from common.kv.state import PromptImages
    from common.model.qwen4_exp.positions import mrope_positions

    sparse = {"indexer_budget": 8, "indexer_compress_ratio": 4}
    path = make_model(tmp_path / "m", preset="tiny", arch="qwen4_exp", overrides=sparse)
    g = torch.Generator().manual_seed(4)
    image = 1022  # the tiny config's image token
    prompt = [*torch.randint(3, 1000, (5,), generator=g).tolist(), *[image] * 12]
    prompt += torch.randint(3, 1000, (6,), generator=g).tolist()
    mrope, delta = mrope_positions(prompt, image, [(1, 4, 12)], 2)
    embeds = torch.randn(12, 64, generator=g)

    def decode(fused: bool, rope_delta: int) -> torch.Tensor:
        engine = Engine(WorkerConfig(str(path), device=DEVICE, max_running=1, fused_kernels=fused))
        seq = engine.runner.new_sequence()
        seq.images = PromptImages(torch.arange(5, 17), embeds.to(DEVICE), mrope)
        seq.rope_delta = rope_delta
        steps = [engine.runner.forward([seq], [prompt])]
        seq.images = None
        for _ in range(5):
            steps.append(engine.runner.forward([seq], [[int(steps[-1][-1].argmax())]]))
        return torch.cat(steps)

    want = decode(False, delta)
    torch.testing.assert_close(decode(True, delta), want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(decode(True, 0)[1:], want[1:], rtol=1e-3, atol=1e-3)
