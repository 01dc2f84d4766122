"""The torch attention backend attends in slices of its queries when the scores would be large: the same
output as in one slice, for a chunk of a prompt with grouped heads, a window and a sparse key selection."""

from __future__ import annotations

import pytest
import torch

from common.kv.backend import TorchPagedBackend, kv_specs
from common.kv.batch import ForwardBatch
from common.kv.state import StatePool


@pytest.mark.parametrize("mode", ["causal", "window", "selected"])
def test_query_slices_change_nothing(mode: str) -> None:
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 6, 2, 8
    pool = StatePool(
        [kv_specs(kv_heads, dim, torch.float32)], num_pages=16, page_size=4, max_seqs=2, device="cpu"
    )
    seqs = [pool.new_sequence() for _ in range(2)]
    for seq, cached, new in zip(seqs, (5, 0), (7, 9), strict=True):  # a chunk after a cached prefix
        pool.reserve(seq, cached + new)
        seq.num_cached = cached
    layer = pool.layer(0)
    layer.paged["k"].copy_(torch.randn(layer.paged["k"].shape, generator=gen))
    layer.paged["v"].copy_(torch.randn(layer.paged["v"].shape, generator=gen))
    batch = ForwardBatch.build(seqs, [list(range(7)), list(range(9))], 4, "cpu")
    q = torch.randn(16, heads, dim, generator=gen)
    k, v = torch.randn(16, kv_heads, dim, generator=gen), torch.randn(16, kv_heads, dim, generator=gen)
    window = 4 if mode == "window" else None
    selected = None
    if mode == "selected":  # each query: its own position and the two before, where they exist
        selected = torch.clamp(batch.positions[:, None] - torch.arange(3)[None, :], min=-1)
    outs = []
    for score_bytes in (1 << 30, 1):  # one slice; one query row per slice
        backend = TorchPagedBackend()
        backend.score_bytes = score_bytes
        outs.append(
            backend.forward(q, k, v, layer, backend.plan(batch), 0.3, window=window, selected=selected)
        )
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)
