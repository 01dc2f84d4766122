"""The conv kernels against `causal_conv`: the decode step (one token per sequence) and the flat-layout pass
(sequences of many tokens, shorter and longer than the history, new and continued): outputs, with and
without SiLU, and the histories updated in place in scattered slots, at dilation 1 (GDN) and 3 (PLE)."""

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


@pytest.mark.parametrize(
    ("kernel", "dilation", "silu", "split"),
    [(4, 1, True, None), (4, 3, False, None), (2, 1, False, None), (4, 1, True, [40, 40, 120])],
)
def test_conv_prefill_matches_causal_conv(kernel: int, dilation: int, silu: bool, split: list | None) -> None:
    """With `split`, x is a strided view (columns of a wider projection, as GDN's) and the output comes
    as contiguous groups of channels."""
    from common.kernels.causal_conv import conv_prefill

    gen = torch.Generator().manual_seed(10 + kernel * dilation)
    channels, slots_total, lens = 200, 6, [1, 37, 5, 2]  # 1 and 2 tokens: less than a history of 3 or 6
    wide = torch.randn(sum(lens), channels + 24, generator=gen)
    x = wide[:, 8 : 8 + channels] if split else wide[:, :channels].contiguous()
    history = torch.randn(slots_total, channels, (kernel - 1) * dilation, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    cached, slots = [4, 0, 9, 3], [5, 0, 2, 3]
    seqs = [SequenceState(slot=s, pages=[0, 1, 2], num_cached=c) for s, c in zip(slots, cached, strict=True)]
    batch = ForwardBatch.build(seqs, [[1] * n for n in lens], page_size=16, device="cpu")
    pad = Padding.of(batch)
    want_history = history.clone()
    want = causal_conv(x, want_history, batch.slot_ids, weight, pad, dilation)
    want = F.silu(want) if silu else want

    got_history = history.to(DEVICE)
    on = {name: t.to(DEVICE) for name, t in (("seq", pad.seq), ("offset", pad.offset), ("lens", pad.lens))}
    x_on = wide.to(DEVICE)[:, 8 : 8 + channels] if split else x.to(DEVICE)
    got = conv_prefill(
        x_on, got_history, batch.slot_ids.to(DEVICE), weight.to(DEVICE), **on, dilation=dilation,
        silu=silu, split=split,
    )  # fmt: skip
    if split:
        assert [g.shape[1] for g in got] == split and all(g.is_contiguous() for g in got)
        got = torch.cat(got, dim=1)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_history.cpu(), want_history)
