"""The fused router choice against `route`: the same experts in the same order, the same weights, with and
without renormalisation, for top-1 to top-10 of 5 to 512 experts."""

from __future__ import annotations

import pytest
import torch

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_kernel_hands_out_the_replay(dtype: torch.dtype) -> None:
    """RoutingReplayer.in_router: the router's kernel hands out the trace's rows (route_fused's `replay`), the
    same rows, weights and cursors as the router's kernel followed by the replay's, for calls of one token
    and of several (whose last program to finish moves the cursor on), past the trace's end."""
    from common.experts.routing import replayer_for
    from common.kernels import arrival
    from common.kernels.routing import route_fused

    layers = [1, 3]
    plain, fused = (replayer_for("synthetic-zipf:tokens=20,seed=2", layers, 64, 4) for _ in range(2))
    plain.fused = fused.fused = fused.in_router = True
    plain.in_router = False
    assert plain.kernel_rows(1, torch.device(DEVICE)) is None  # called, not in the router's kernel
    gen = torch.Generator().manual_seed(1)
    for n in (1, 3, 1, 9, 37):
        for layer in layers:
            logits = (torch.randn(n, 64, generator=gen) * 3).to(DEVICE)
            weights, ids = route_fused(logits, 4, True, dtype)
            want = plain(layer, ids, weights)
            got = route_fused(logits, 4, True, dtype, fused.kernel_rows(layer, logits.device))[::-1]
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[1].dtype == dtype
        (_, _, want_cursor), (_, _, cursor) = plain._on(logits.device), fused._on(logits.device)
        assert torch.equal(cursor, want_cursor)
    assert not arrival.counters(logits.device, 1).any()


def test_moe_block_replays_in_its_routers_kernel(tmp_path) -> None:
    """A model whose fused router hands out the replay decodes the tokens the router-then-replay model does
    (the engine's greedy decode of a tiny qwen3_moe, on the GPU where there is one)."""
    from common.engine import Engine
    from common.experts.routing import install_routing_hook, replayer_for
    from common.kernels import use_fused_kernels
    from common.model.synthetic import make_model
    from common.sampling import SamplingParams

    path = make_model(tmp_path, preset="tiny", arch="qwen3_moe")
    tokens = []
    for in_router in (False, True):
        engine = Engine(path, max_seqs=1, max_context=64, device=DEVICE)
        cfg = engine.config
        replayer = replayer_for(
            "synthetic-zipf:tokens=8,seed=1", list(cfg.moe_layers), cfg.num_experts, cfg.top_k
        )
        replayer.in_router = in_router
        install_routing_hook(engine.model, replayer)
        use_fused_kernels(engine.model, True)
        assert (replayer.kernel_rows(cfg.moe_layers[0], torch.device(DEVICE)) is not None) == in_router
        result = engine.generate(
            [[5, 9, 2, 7]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        )[0]
        tokens.append(result.token_ids)
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6


@pytest.mark.parametrize("hook_first", [True, False])
def test_replay_takes_the_fused_switch_whichever_comes_first(tmp_path, hook_first: bool) -> None:
    """use_fused_kernels sets an installed replay's switch; a replay installed after it takes the blocks'."""
    from common.engine import Engine
    from common.experts.routing import install_routing_hook, replayer_for
    from common.kernels import use_fused_kernels
    from common.model.synthetic import make_model

    engine = Engine(make_model(tmp_path, preset="tiny", arch="qwen3_moe"), max_seqs=1, max_context=32)
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
