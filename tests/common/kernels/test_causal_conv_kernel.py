"""The decode conv step against `causal_conv` (one token per sequence): outputs, with and without SiLU, and
the histories shifted in place in scattered slots, at dilation 1 (GDN) and 3 (PLE)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.kv.batch import ForwardBatch
from common.kv.state import SequenceState
from common.model.qwen4_exp.varlen import Padding, causal_conv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("kernel", "dilation", "silu"), [(4, 1, True), (4, 3, False), (2, 1, False)])
def test_conv_step_matches_causal_conv(kernel: int, dilation: int, silu: bool) -> None:
    from common.kernels.causal_conv import conv_step

    gen = torch.Generator().manual_seed(kernel * dilation)
    channels, slots_total = 200, 5  # channels not a multiple of the block: masked tail
    x = torch.randn(3, channels, generator=gen)
    history = torch.randn(slots_total, channels, (kernel - 1) * dilation, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    seqs = [SequenceState(slot=s, pages=[0], num_cached=4) for s in (4, 0, 2)]
    batch = ForwardBatch.build(seqs, [[1], [2], [3]], page_size=16, device="cpu")
    want_history = history.clone()
    want = causal_conv(x, want_history, batch.slot_ids, weight, Padding.of(batch), dilation)
    want = F.silu(want) if silu else want

    got_history = history.to(DEVICE)
    slots = batch.slot_ids.to(DEVICE)
    got = conv_step(x.to(DEVICE), got_history, slots, weight.to(DEVICE), dilation, silu, block=64)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_history.cpu(), want_history)
