"""The fused router choice against `route`: the same experts in the same order, the same weights, with and
without renormalisation, for top-1 to top-10 of 5 to 512 experts."""

from __future__ import annotations

import pytest
import torch

from common.config import WorkerConfig
from common.model.moe import route

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("experts", "k"), [(8, 2), (60, 4), (512, 10), (5, 1)])
@pytest.mark.parametrize("normalize", [True, False])
def test_route_fused_matches_route(experts: int, k: int, normalize: bool) -> None:
    from common.kernels.routing import route_fused

    logits = torch.randn(7, experts, generator=torch.Generator().manual_seed(experts)) * 3
    want_weights, want_ids = route(logits, k, normalize)
    weights, ids = route_fused(logits.to(DEVICE), k, normalize)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(weights.cpu(), want_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_replay_hands_out_the_same_rows(dtype: torch.dtype) -> None:
    """The same rows and weights (in the router's dtype), and the same cursors after every call: calls of a
    few tokens (one program, which advances the cursor) and a long one (a program per 16 tokens)."""
    from common.experts.routing import replayer_for
    from common.kernels.routing import REPLAY_ONE_PROGRAM

    layers = [1, 3]
    plain, fused = (replayer_for("synthetic-zipf:tokens=20,seed=2", layers, 16, 4) for _ in range(2))
    fused.fused = True
    for n in (3, 1, 9, 12, 37, REPLAY_ONE_PROGRAM + 5):  # past the trace's end: rows cycle
        for layer in layers:
            ids = torch.zeros(n, 4, dtype=torch.int64, device=DEVICE)
            weights = torch.zeros(n, 4, dtype=dtype, device=DEVICE)
            want, got = plain(layer, ids, weights), fused(layer, ids, weights)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            assert got[1].dtype == dtype
        (_, _, want_cursor), (_, _, cursor) = plain._on(ids.device), fused._on(ids.device)
        assert torch.equal(cursor, want_cursor)


@pytest.mark.parametrize("hook_first", [True, False])
def test_replay_takes_the_fused_switch_whichever_comes_first(tmp_path, hook_first: bool) -> None:
    """use_fused_kernels sets an installed replay's switch; a replay installed after it takes the blocks'."""
    from common.engine.engine import Engine
    from common.experts.routing import install_routing_hook, replayer_for
    from common.model.fused_kernels import use_fused_kernels
    from common.model.synthetic.checkpoint import make_model

    engine = Engine(
        WorkerConfig(
            str(make_model(tmp_path, preset="tiny", arch="qwen3_moe")),
            max_running=1,
            max_context=32,
            dtype="bfloat16",
        )
    )
    cfg, model = engine.config, engine.model
    layers = list(cfg.moe_layers)
    replayer = replayer_for("synthetic-zipf:tokens=8,seed=1", layers, cfg.num_experts, cfg.top_k)
    steps = [lambda: install_routing_hook(model, replayer), lambda: use_fused_kernels(model, True)]
    for step in steps if hook_first else steps[::-1]:
        step()
    assert replayer.fused
    use_fused_kernels(model, False)
    assert not replayer.fused


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_route_fused_weights_in_the_model_dtype(dtype: torch.dtype) -> None:
    """Weights asked in the model's dtype: bf16 rounded in the kernel, fp16 cast after it, both equal to the
    fp32 weights cast by torch (what the MoE block did after the kernel), bit for bit."""
    from common.kernels.routing import route_fused

    logits = (torch.randn(9, 512, generator=torch.Generator().manual_seed(4)) * 3).to(DEVICE)
    fp32, ids = route_fused(logits, 10, True)
    weights, same = route_fused(logits, 10, True, dtype)
    assert weights.dtype == dtype and torch.equal(same, ids)
    assert torch.equal(weights, fp32.to(dtype))
