"""Gated DeltaNet's prefill hands fla-core its varlen chunk list built from the host's lengths, so fla neither
reads the lengths back from the device nor copies a list it built on the host (a sync in every layer)."""

from __future__ import annotations

import torch

from common.kv.batch import ForwardBatch
from common.kv.state import SequenceState


def test_fla_chunk_list_from_the_host_lengths() -> None:
    """fla's [chunks, 2] list (sequence, chunk within it) for 64-token chunks: 1, 64, 65 and 130 tokens take
    1, 1, 2 and 3 chunks; the lengths' prefix sums ride along on the host."""
    from common.model.qwen4_exp.gdn import _fla_varlen

    lens = [1, 64, 65, 130]
    seqs = [SequenceState(slot=b, pages=list(range(b * 9, b * 9 + 9))) for b in range(len(lens))]
    batch = ForwardBatch.build(seqs, [[5] * n for n in lens], 16, "cpu")

    varlen = _fla_varlen(batch, torch.device("cpu"))

    want = [[0, 0], [1, 0], [2, 0], [2, 1], [3, 0], [3, 1], [3, 2]]
    assert varlen["chunk_indices"].tolist() == want
    assert varlen["cu_seqlens_cpu"].tolist() == [0, 1, 65, 130, 260]
    assert _fla_varlen(batch, torch.device("cpu")) is varlen  # once per pass
