"""QSA's decode prologue (common/kernels/qsa_prologue.py): the indexer's key compression and the three norms
and rotations as programs of one kernel give what the four kernels give one after another, bit for bit (the
same bodies), in a tiny qwen4_exp decoding past the indexer's budget: the same logits, the same keys, values
and block keys in the pages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.engine import Engine
from common.model.qwen4_exp.qsa import QSAttention
from common.model.synthetic import make_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _decode(path: Path, prompt: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Logits of a prefill and four decode steps, and the QSA layers' pages after them."""
    engine = Engine(
        path, dtype=torch.float32, device=DEVICE, max_seqs=1, cuda_graphs=False, fused_kernels=True
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
    monkeypatch.setattr(qsa_prologue, "qsa_prologue", lambda *a: launches.append(1) or plain(*a))
    fused = _decode(path, prompt)
    assert launches  # every decode step's QSA layers
    launches.clear()
    monkeypatch.setattr(QSAttention, "prologue_kernel", False)
    apart = _decode(path, prompt)
    assert not launches
    for got, want in zip([*fused[0], *fused[1]], [*apart[0], *apart[1]], strict=True):
        assert torch.equal(got, want)
