"""The CUDA C one-row GEMV (common/kernels/gemv_native.py) on the GPU: against an fp32 product at the decode
step's shapes and edges (two rows a warp, rows not a whole block, a bias, the widest K), after another kernel
in a recorded graph with programmatic launch, and chosen by fused_linear.linear where it takes the call."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from common.kernels import gemv_native
from common.kernels.config import KERNELS
from common.model import fused_linear


def _case(n: int, k: int, bias: bool, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(1, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    b = torch.randn(n, device="cuda", generator=g).bfloat16() if bias else None
    want = x.float() @ w.float().T + (b.float() if bias else 0)
    return x, w, b, want


@pytest.mark.parametrize(
    ("n", "k", "bias"),
    [(2560, 6144, False), (1800, 2560, False), (1001, 2560, True), (37, 8192, True), (8, 256, False)],
)
def test_matches_the_fp32_product(n: int, k: int, bias: bool) -> None:
    x, w, b, want = _case(n, k, bias)
    assert gemv_native.takes(x, w)
    got = gemv_native.gemv_row(x, w, b)
    assert got.shape == (1, n) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


def test_in_a_recorded_graph_after_the_kernel_that_writes_x() -> None:
    x, w, _, want = _case(2560, 6144, False, seed=1)
    source = torch.zeros_like(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        staged = source * 1 + x  # the kernel just before writes x; the GEMV waits for it
        got = gemv_native.gemv_row(staged, w)
    graph.replay()
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    source.fill_(1.0)  # a new x (x + 1, rounded to bf16): the replay reads it, not the first
    graph.replay()
    torch.testing.assert_close(got.float(), staged.float() @ w.float().T, rtol=1e-2, atol=1e-2)


def test_linear_takes_it_where_it_applies(monkeypatch) -> None:
    x, w, _, want = _case(1800, 2560, False, seed=2)
    calls = []
    plain = gemv_native.gemv_row
    monkeypatch.setattr(gemv_native, "gemv_row", lambda *a, **kw: calls.append(a[1].shape) or plain(*a, **kw))
    torch.testing.assert_close(fused_linear.linear(x, w).float(), want, rtol=1e-2, atol=1e-2)
    fused_linear.linear(torch.cat([x, x]), w)  # two rows: the Triton GEMV
    assert calls == [(1800, 2560)]
    triton_only = replace(KERNELS, gemv_native=False)
    torch.testing.assert_close(
        fused_linear.linear(x, w, kernels=triton_only).float(), want, rtol=1e-2, atol=1e-2
    )
    assert len(calls) == 1
