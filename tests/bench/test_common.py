"""bench/common.py's byte count of a decode step's weights (the HBM side of decode's limit)."""

from __future__ import annotations

from torch import nn

from bench.common import step_weight_bytes
from common.model.fused_linear import fuse_linears


class _Tiny(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 8)  # 3,200 bytes
        self.q, self.k = nn.Linear(8, 16, bias=False), nn.Linear(8, 4, bias=False)  # 512 + 128
        self.lm_head = nn.Linear(8, 100, bias=False)  # 3,200
        if tied:
            self.lm_head.weight = self.embed.weight


def test_counts_embedding_rows_once_and_fused_views_once() -> None:
    model = _Tiny(tied=False)
    assert step_weight_bytes(model, rows=2, device_type="cpu") == 2 * 32 + 512 + 128 + 3200
    model.fused = fuse_linears([model.q, model.k])  # the Linears' weights become views of the fused one
    assert model.fused is not None
    assert step_weight_bytes(model, rows=2, device_type="cpu") == 2 * 32 + 512 + 128 + 3200


def test_a_tied_embedding_is_read_whole_by_the_head() -> None:
    model = _Tiny(tied=True)
    assert step_weight_bytes(model, rows=2, device_type="cpu") == 3200 + 512 + 128
    assert step_weight_bytes(model, rows=2, device_type="cuda") == 0  # nothing on that device


def test_state_bytes_count_slots_whole_and_the_attended_tokens() -> None:
    import torch

    from bench.common import step_state_bytes
    from common.kv.state import PagedSpec, SlotSpec, StatePool

    gdn = {"recurrent": SlotSpec((2, 4, 4), torch.float32), "conv": SlotSpec((8, 3), torch.bfloat16)}
    kv = PagedSpec((2, 8), torch.bfloat16, kv=True)  # 32 bytes a token
    attention = {"k": kv, "v": kv}
    qsa = {
        **attention,
        "index_k": PagedSpec((4,), torch.bfloat16),
        "index_block": PagedSpec((4,), torch.bfloat16),
    }
    pool = StatePool([gdn, attention, qsa], num_pages=4, page_size=16, max_seqs=2, device="cpu")
    slot = 2 * 4 * 4 * 4 + 8 * 3 * 2  # 176
    full = 2 * 32 * 100  # the plain attention layer reads the whole context
    selected = (
        2 * 32 * 64 + 8 * 100 / 4 + 8 * 4
    )  # the QSA layer: the budget, the blocks, one block's raw keys
    assert step_state_bytes(pool, 1, 100, budget=64, ratio=4) == slot + full + selected
    assert step_state_bytes(pool, 3, 100, budget=64, ratio=4) == 3 * (slot + full + selected)
    assert step_state_bytes(pool, 1, 10, budget=64, ratio=4) == slot + 2 * 32 * 10 * 2 + 8 * 10 / 4 + 8 * 4
