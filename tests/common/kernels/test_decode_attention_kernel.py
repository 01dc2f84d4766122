"""Paged decode attention (one query per sequence) against the torch backend: dense and with a sparse key
selection, grouped query heads, pages scattered, sequences of different lengths, bf16 and fp8 pages, a
sliding window."""

from __future__ import annotations

import pytest
import torch

from common.kv.backend import TorchPagedBackend, kv_specs
from common.kv.batch import ForwardBatch
from common.kv.state import StatePool

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(fp8: bool):
    gen = torch.Generator().manual_seed(int(fp8))
    heads, kv_heads, dim, page = 4, 2, 32, 4
    specs = [kv_specs(kv_heads, dim, torch.float8_e4m3fn if fp8 else torch.float32)]
    pool = StatePool(specs, num_pages=16, page_size=page, max_seqs=3, device=DEVICE)
    if fp8:
        pool.kv_scales.copy_(torch.tensor([[0.05, 0.04]]))
    layer = pool.layer(0)
    for name in ("k", "v"):
        fill = torch.randn(layer.paged[name].shape, generator=gen)
        layer.paged[name].copy_(
            fill.to(layer.paged[name].dtype) if not fp8 else (fill * 8).to(torch.float8_e4m3fn)
        )
    seqs = [pool.new_sequence() for _ in range(3)]
    for seq, cached in zip(seqs, (9, 3, 14), strict=True):
        pool.reserve(seq, cached + 1)
        seq.num_cached = cached
    batch = ForwardBatch.build(seqs, [[1], [2], [3]], page, DEVICE)
    q = torch.randn(3, heads, dim, generator=gen).to(DEVICE)
    k = torch.randn(3, kv_heads, dim, generator=gen).to(DEVICE)
    v = torch.randn(3, kv_heads, dim, generator=gen).to(DEVICE)
    return layer, batch, q, k, v


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("mode", ["dense", "sparse", "window"])
def test_fused_decode_attention_matches_torch(fp8: bool, mode: str) -> None:
    selected = window = None
    if mode == "sparse":  # positions a query may see, −1 unused (its own position always among them)
        selected = torch.tensor([[0, 4, 5, -1, 9], [1, 3, -1, -1, -1], [2, 7, 8, 13, 14]], device=DEVICE)
    if mode == "window":
        window = 5
    outs = []
    for fused in (False, True):
        layer, batch, q, k, v = _case(fp8)
        backend = TorchPagedBackend()
        backend.fused_decode = fused
        plan = backend.plan(batch)
        outs.append(backend.forward(q, k, v, layer, plan, 0.2, window=window, selected=selected))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
