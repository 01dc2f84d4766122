"""Sums folded into the kernels that write their terms (common/kernels/arrival.py): the GEMV's chunk sums and
the int4 MoE's combine give what their separate kernels give, leave every counter at zero, and hold in a
recorded graph replayed again and again and on two streams at once (CUDA)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from common.kernels import arrival
from common.kernels.config import KERNELS, KernelConfig
from common.kernels.gemv import GemvConfig, gemv
from tests.common.kernels.test_moe_int4_decode import DEVICE, _two_token_case

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def separate() -> KernelConfig:
    """The separate sums' kernels (KernelConfig.fold_sums off); the defaults fold (up to `arrival.ROWS`
    rows)."""
    return replace(KERNELS, fold_sums=False)


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same additions in the same order: bit for bit in the interpreter; compiled, to fp32 rounding (two
    kernels' code may contract apart)."""
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert DEVICE == "cuda" or torch.equal(got, want)


def _zeroed() -> bool:
    return not arrival.counters(torch.device(DEVICE), 1).any()


def _gemv_case(rows: int = 1) -> tuple:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 700, generator=gen).to(DEVICE)
    w = (torch.randn(200, 700, generator=gen) * 0.05).to(DEVICE)
    return x, w, torch.randn(200, generator=gen).to(DEVICE)


CHUNKED = GemvConfig(bn=32, bk=128, splits=3, dot_rows=2)  # 7 row tiles × 3 chunks of 256 inputs


@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_chunks_summed_by_the_last_to_arrive(separate, monkeypatch, rows: int) -> None:
    """One row, and three with the sums folded up to three rows (by default from two rows on a second
    kernel sums them)."""
    x, w, b = _gemv_case(rows)
    want = gemv(x, w, b, config=CHUNKED, kernels=separate)  # separate sums' kernel
    monkeypatch.setattr(arrival, "ROWS", rows)
    for _ in range(2):  # the counters back at zero after each call
        _assert_same(gemv(x, w, b, config=CHUNKED), want)
        assert _zeroed()
    torch.testing.assert_close(want, F.linear(x, w, b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("shared", [False, True])
def test_moe_choices_summed_by_the_last_to_arrive(separate, monkeypatch, shared: bool, tokens: int) -> None:
    """One token, and two with the sums folded up to two (each token its own counters)."""
    from common.kernels.config import DecodeConfig
    from common.kernels.moe_int4 import moe_int4_decode

    monkeypatch.setattr(arrival, "ROWS", tokens)
    gen = torch.Generator().manual_seed(3)
    pool, x, weights = _two_token_case(gen, experts=5, k=3)
    rows = torch.tensor([[1, 3, 3], [0, 4, 2]], device=DEVICE)  # a row twice in one token
    extra = {}
    if shared:
        extra = {"shared": torch.randn(2, 256, generator=gen).to(DEVICE)}
        extra["shared_gate"] = torch.randn(2, 4, generator=gen).to(DEVICE)[:, 1:2]  # a strided column
    x, rows, weights = x[:tokens], rows[:tokens], weights[:tokens]
    extra = {name: v[:tokens] for name, v in extra.items()}
    for words in (False, True):
        shape = DecodeConfig(block=8, down_block=32, words=words)
        want = moe_int4_decode(x, rows, weights, pool, config=shape, kernels=separate, **extra)
        got = moe_int4_decode(x, rows, weights, pool, config=shape, **extra)
        _assert_same(got, want)
        assert _zeroed()


def test_counters_refuse_more_tiles_than_they_hold() -> None:
    with pytest.raises(AssertionError, match="counters"):
        arrival.counters(torch.device(DEVICE), arrival.COUNTERS + 1)


@cuda
def test_folded_gemv_in_a_recorded_graph() -> None:
    """Recorded on a stream whose counters are made in the recording (a memset node), replayed with new
    inputs: every replay's sums right, the counters left at zero."""
    x, w, b = _gemv_case()
    gemv(x, w, b, config=CHUNKED)  # warm: compiled outside the recording
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemv(x, w, b, config=CHUNKED)
    for seed in range(3):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    torch.cuda.synchronize()
    assert _zeroed()


@cuda
def test_folded_gemv_on_two_streams_at_once(monkeypatch) -> None:
    """Decode groups run the same projections on their own streams at once: each stream its own counters."""
    monkeypatch.setattr(arrival, "ROWS", 3)
    cases = [_gemv_case(rows) for rows in (1, 3)]
    streams = [torch.cuda.Stream() for _ in cases]
    outs = []
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    for _ in range(20):
        for stream, (x, w, b) in zip(streams, cases, strict=True):
            with torch.cuda.stream(stream):
                outs.append(gemv(x, w, b, config=CHUNKED))
    torch.cuda.synchronize()
    for i, y in enumerate(outs):
        x, w, b = cases[i % 2]
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    buffers = {arrival.counters(torch.device(DEVICE), 1).data_ptr()}
    for stream in streams:
        with torch.cuda.stream(stream):
            buffers.add(arrival.counters(torch.device(DEVICE), 1).data_ptr())
    assert len(buffers) == 3
