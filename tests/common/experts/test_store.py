"""The host expert store: one exact-size allocation, a fixed stride per expert, views of what was written."""

from __future__ import annotations

import math

import torch

from common.experts.formats import get_format
from common.experts.store import HostExpertStore


def test_layout_is_exact_and_strided() -> None:
    fmt = get_format("int4")
    components = fmt.components(256, 128)
    store = HostExpertStore(num_layers=3, num_experts=5, components=components, map_for_gpu=False)
    expected = sum(-(-5 * math.prod(s) * d.itemsize // 256) * 256 for s, d in components.values()) * 3
    assert store.nbytes == expected == store.buffer.numel()  # no power-of-two rounding
    for name, block in store.parts[1].items():
        shape, dtype = components[name]
        assert block.shape == (5, *shape) and block.dtype == dtype and block.is_contiguous()
    assert store.expert_bytes == fmt.expert_nbytes(256, 128)


def test_fill_and_read_back() -> None:
    fmt = get_format("bf16")
    store = HostExpertStore(2, 4, fmt.components(64, 32), map_for_gpu=False)
    weights = [(torch.randn(64, 64), torch.randn(64, 32)) for _ in range(4)]
    store.fill(1, [fmt.pack(g, d) for g, d in weights])
    for e, (gate_up, down) in enumerate(weights):
        got = fmt.unpack(store.expert(1, e), torch.float32)
        assert torch.equal(got[0], gate_up.to(torch.bfloat16).float())
        assert torch.equal(got[1], down.to(torch.bfloat16).float())
    assert store.parts[0]["gate_up"].data_ptr() != store.parts[1]["gate_up"].data_ptr()
