"""The MoE dispatch kernel against the three kernels it puts side by side (route_fused, replay_rows,
swiglu_down): the same experts and replayed rows bit for bit, the same cursors, the router's weights and the
shared expert to rounding (on a GPU their sums are split over other threads); and a model decoding the same
with it as without."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from common.kernels.config import KERNELS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _shared(rows: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate and up as views of one wider projection output (as the MoE block's fused input GEMM gives them),
    widths not multiples of the blocks, and a down weight [H, I]."""
    hidden, inter = 40, 200
    fused = torch.randn(rows, 3 + 2 * inter, generator=gen).to(DEVICE)
    down = (torch.randn(hidden, inter, generator=gen) * 0.1).to(DEVICE)
    return fused[:, 3 : 3 + inter], fused[:, 3 + inter :], down


_ROUNDING = {torch.float32: {"rtol": 1e-5, "atol": 1e-6}, torch.bfloat16: {"rtol": 8e-3, "atol": 1e-5}}
"""A few fp32 ulps; one bf16 ulp (the fp32 weight then rounded to bf16 may cross a rounding boundary)."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("replayed", "with_shared"), [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize(("warps", "shared_block"), [(4, 8), (1, 2)])
def test_dispatch_equals_the_three_kernels(
    dtype: torch.dtype, replayed: bool, with_shared: bool, warps: int, shared_block: int, monkeypatch
) -> None:
    """At the default shape and at one warp with 2 shared-expert rows a program (the benchmark's switches)."""
    from common.experts.routing import replayer_for
    from common.kernels import moe_dispatch as dispatch
    from common.kernels.gated_mlp import swiglu_down
    from common.kernels.moe_dispatch import moe_dispatch
    from common.kernels.routing import route_fused

    monkeypatch.setattr(dispatch, "WARPS", warps)
    monkeypatch.setattr(dispatch, "SHARED_BLOCK", shared_block)

    gen = torch.Generator().manual_seed(3)
    layers, experts, k = [0, 2], 60, 4
    plain, fused = (replayer_for("synthetic-zipf:tokens=20,seed=2", layers, experts, k) for _ in range(2))
    fused.fused = True
    for rows in (1, 3, 16):  # the cursors move on between calls, past the trace's end
        logits = (torch.randn(rows, experts, generator=gen) * 3).to(DEVICE)
        gate, up, down = _shared(rows, gen)
        for layer in layers:
            replay = fused.device_rows(layer, logits.device) if replayed else None
            got_w, got_ids, got_shared = moe_dispatch(
                logits, k, True, dtype, replay, (gate, up, down) if with_shared else None
            )
            want_w, want_ids = route_fused(logits, k, True, dtype)
            if replayed:
                want_ids, want_w = plain(layer, want_ids, want_w)
            assert got_w.dtype == want_w.dtype and torch.equal(got_ids, want_ids)
            if replayed:  # copied from the trace
                assert torch.equal(got_w, want_w)
            else:
                torch.testing.assert_close(got_w, want_w, **_ROUNDING[dtype])
            if with_shared:
                torch.testing.assert_close(got_shared, swiglu_down(gate, up, down), rtol=1e-5, atol=1e-6)
            else:
                assert got_shared is None
        (_, _, want_cursor), (_, _, cursor) = plain._on(logits.device), fused._on(logits.device)
        assert torch.equal(cursor, want_cursor)


def test_a_recorder_is_called_not_dispatched() -> None:
    """A hook with no rows on the device (a recorder, an unfused replay) is called with the router's choice:
    the dispatch stands aside."""
    from common.experts.routing import RoutingRecorder, replayer_for

    assert RoutingRecorder([0], 8).device_rows(0, torch.device(DEVICE)) is None
    replayer = replayer_for("synthetic-zipf:tokens=4,seed=1", [0], 8, 2)
    assert replayer.device_rows(0, torch.device(DEVICE)) is None  # unfused: its torch gather is called
    replayer.fused = True
    ids, weights, cursor, layer = replayer.device_rows(0, torch.device(DEVICE))
    assert ids.shape == (4, 1, 2) and weights.dtype == torch.float32 and cursor.shape == (1,) and layer == 0


def test_a_model_decodes_the_same_dispatched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny qwen4_exp model (shared experts, replayed routing) with the fused kernels: the same logits at
    every step of a prefill and a greedy decode with the dispatch (taken at every pass's MoE layers: none
    has more than DOWN_ROWS rows) as with the three kernels, to rounding; the experts' kernels told their
    rows are settled (written two kernels back) only when the shared expert's own kernel ran in between."""
    from common.config import WorkerConfig
    from common.engine.engine import Engine
    from common.kernels import moe_dispatch
    from common.model.moe import SparseMoeBlock
    from common.model.synthetic.checkpoint import make_model

    path = make_model(tmp_path / "m", preset="tiny", arch="qwen4_exp")
    calls = []
    dispatch = moe_dispatch.moe_dispatch
    monkeypatch.setattr(
        moe_dispatch, "moe_dispatch", lambda *args, **kw: calls.append(args) or dispatch(*args, **kw)
    )
    settled = {True: [], False: []}
    prompt = torch.randint(3, 1000, (9,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = []
    for enabled in (True, False):
        engine = Engine(
            WorkerConfig(
                str(path),
                device=DEVICE,
                max_running=1,
                cuda_graphs=False,
                replay_routing="synthetic-zipf:seed=5",
                fused_kernels=True,
                kernels=replace(KERNELS, moe_dispatch=enabled),
            )
        )
        provider = next(m.experts for m in engine.model.modules() if isinstance(m, SparseMoeBlock))
        monkeypatch.setattr(provider, "compute", _recording_settled(provider.compute, settled[enabled]))
        seq = engine.runner.new_sequence()
        steps = [engine.runner.forward([seq], [prompt])]
        for _ in range(4):
            steps.append(engine.runner.forward([seq], [[int(steps[-1].argmax(-1))]]))
        logits.append(torch.cat(steps))
    moe_layers = len(engine.config.moe_layers)
    assert len(calls) == 5 * moe_layers  # the 9-token prefill too
    assert all(args[4] is not None and args[5] is not None for args in calls)  # a replay and a shared expert
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)
    assert settled[True] == [False] * len(calls) and settled[False] == [True] * len(calls)


def _recording_settled(compute: Callable[..., torch.Tensor], seen: list[bool]) -> Callable[..., torch.Tensor]:
    """`compute` (a provider's bound method, called positionally by the MoE block) noting its `settled`."""
    return lambda *args: seen.append(args[-1]) or compute(*args)
