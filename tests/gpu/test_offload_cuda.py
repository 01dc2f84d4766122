"""The expert cache and arena with CUDA tensors and the real pinned, mapped host store: same tokens as the
all-resident model on the GPU for every capacity, policy and prefill chunk (whole-layer streaming included);
decode steps that never synchronise; copies on the side stream that are always waited for."""

from __future__ import annotations

import gc
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.experts.cache_tables import CacheTables
from common.experts.formats import FORMATS, PUBLISHED_FORMATS, get_format
from common.experts.offload import OffloadedExperts
from common.experts.store import HostExpertStore
from common.model.resident import batched_expert_mlp
from common.model.synthetic.checkpoint import make_model
from common.protocol import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_offloaded_experts_on_cuda(tmp_path: Path) -> None:
    path = make_model(tmp_path / "m", preset="tiny", arch="qwen3_moe")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (6, 23, 15)]
    reference = [
        r.token_ids for r in Engine(WorkerConfig(str(path), device="cuda")).generate(prompts, GREEDY)
    ]
    for capacity in ["3", "0.25", "all"]:
        for policy in ["lru", "lfu", "lfu-admit"]:
            for chunk in [5, 8192]:  # 8192: whole prompts, T·k ≥ 4·E, whole layers streamed
                engine = Engine(
                    WorkerConfig(
                        str(path),
                        device="cuda",
                        max_running=2,
                        expert_cache=capacity,
                        cache_policy=policy,
                        prefill_chunk=chunk,
                    )
                )
                provider = engine.offload
                assert provider.store.mapped and provider.tables.slot_of.is_cuda
                assert provider.copies.side is not None
                out = [r.token_ids for r in engine.generate(prompts, GREEDY)]
                provider.tables.check()
                assert out == reference, (capacity, policy, chunk)


# Experts big enough (bf16: 3 MiB) that a copy takes far longer than launching the compute after it: a
# missing join would read stale slots.
E, LAYERS, TOP_K, HIDDEN, INTER = 16, 2, 4, 1024, 512


@pytest.fixture(scope="module", params=[*FORMATS, *PUBLISHED_FORMATS])
def store(request) -> HostExpertStore:
    fmt = get_format(request.param)
    store = HostExpertStore(LAYERS, E, fmt.components(HIDDEN, INTER))
    g = torch.Generator().manual_seed(0)
    for layer in range(LAYERS):
        packed = [
            fmt.pack(
                torch.randn(2 * INTER, HIDDEN, generator=g) * 0.03,
                torch.randn(HIDDEN, INTER, generator=g) * 0.03,
            )
            for _ in range(E)
        ]
        store.fill(layer, packed)
    store.fmt = fmt
    return store


def _provider(store: HostExpertStore, capacity: int, policy: str) -> OffloadedExperts:
    tables = CacheTables(LAYERS, E, [capacity] * LAYERS, policy, device="cuda")
    return OffloadedExperts(store, tables, store.fmt, F.silu, list(range(LAYERS)), "cuda", torch.bfloat16)


def _steps(n: int, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(tokens)])
        x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
        out.append((x.cuda(), ids.cuda(), torch.rand(tokens, TOP_K, generator=g).cuda()))
    return out


@pytest.mark.parametrize(("tokens", "fused"), [(3, False), (1, False), (1, True)])
@pytest.mark.parametrize("policy", ["lru", "lfu-admit"])
def test_decode_on_cuda_never_syncs_and_matches_the_reference(
    store, policy: str, tokens: int, fused: bool
) -> None:
    """With the torch resolution and the resolve kernel (`fused`)."""
    steps = _steps(8, tokens=tokens)
    reference = []
    for layer in range(LAYERS):
        gate_up, down = store.fmt.unpack_many(
            {n: b.cuda() for n, b in store.parts[layer].items()}, torch.bfloat16
        )
        reference.append([batched_expert_mlp(x, gate_up[i], down[i], i, w, F.silu) for x, i, w in steps])
    by_capacity = []
    for capacity in (1, 5, E):
        provider = _provider(store, capacity, policy)
        provider.fused_resolve = provider.copies.merged = fused
        provider.begin_pass(True)
        provider.forward(0, *steps[0])  # warm-up: compiles the copy kernel
        torch.cuda.synchronize()
        outs = []
        torch.cuda.set_sync_debug_mode("error")
        try:
            for x, ids, w in steps:
                provider.begin_pass(True)
                out = []
                for layer in range(LAYERS):
                    prepared = provider.prepare(layer, ids)
                    if (
                        layer + 1 < LAYERS
                    ):  # a lookahead's guess (its stream, its copies) syncs nothing either
                        provider.lookahead(layer + 1, x, lambda x, ids=ids: (ids + 1) % E)
                    out.append(provider.compute(layer, prepared, x, ids, w))
                outs.append(out)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for s, out in enumerate(outs):
            for layer in range(LAYERS):
                if provider.fused_int4 or provider.dense_kernels:  # kernels' fp32 sums: rounding apart
                    torch.testing.assert_close(out[layer], reference[layer][s], atol=2e-2, rtol=2e-2)
                else:
                    assert torch.equal(out[layer], reference[layer][s]), (capacity, s, layer)
        by_capacity.append(outs)
        provider.tables.check()
    for outs in by_capacity[:-1]:  # whatever the cache holds, the rows read are the same bytes: same output
        for out, every_slot in zip(outs, by_capacity[-1], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(out, every_slot, strict=True))


@pytest.mark.parametrize("tokens", [2, 1])
def test_slow_copies_are_waited_for(store, monkeypatch, tokens: int) -> None:
    """The side stream's copies are delayed by ~20 ms each: the main stream must still read the new rows,
    also those a lookahead copied in ahead of their layer."""
    from common.experts import copies as offload  # where CopyStream finds copy_experts

    copy = offload.copy_experts

    def slow(*args, **kwargs) -> None:
        torch.cuda._sleep(40_000_000)  # GPU cycles, on the side stream (the current one inside the launch)
        copy(*args, **kwargs)

    monkeypatch.setattr(offload, "copy_experts", slow)
    steps = _steps(4, tokens=tokens)
    provider = _provider(store, 3, "lru")
    for x, ids, w in steps:
        provider.begin_pass(True)
        for layer in range(LAYERS):
            gate_up, down = store.fmt.unpack_many(
                {n: b.cuda() for n, b in store.parts[layer].items()}, torch.bfloat16
            )
            expect = batched_expert_mlp(x, gate_up[ids], down[ids], ids, w, F.silu)
            prepared = provider.prepare(layer, ids)
            if (
                layer + 1 < LAYERS
            ):  # as a MoE block guesses, between its prepare and compute (right: same ids)
                provider.lookahead(layer + 1, x, lambda x, ids=ids: ids)
            out = provider.compute(layer, prepared, x, ids, w)
            if provider.fused_int4 or provider.dense_kernels:  # fp32 sums: rounding apart (a stale row: more)
                torch.testing.assert_close(out, expect, atol=2e-2, rtol=2e-2)
            else:
                assert torch.equal(out, expect), layer
    counters = provider.tables.counters
    assert int(counters["prefetch_hits"].sum()) > 0  # rows a guess copied (slowly) were read


def test_offloaded_experts_are_read_to_the_host_not_the_device(tmp_path: Path) -> None:
    """A model whose experts do not fit must load: they go from the checkpoint to the host store."""
    # experts dominate; the pool (a tenth of them cached, a spare row, two arena buffers of E rows) is ~28 %
    shape = {"hidden_size": 256, "moe_intermediate_size": 256, "num_experts": 128, "num_hidden_layers": 12}
    path = make_model(tmp_path / "m", preset="tiny", arch="qwen3_moe", overrides=shape)
    gc.collect()  # the earlier tests' engines: what they still hold is not this load's
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    engine = Engine(WorkerConfig(str(path), device="cuda", max_running=1, expert_cache="0.1"))
    cfg = engine.config
    resident = len(cfg.moe_layers) * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4
    # the fp32 experts were never all on the device
    assert torch.cuda.max_memory_allocated() - before < resident


def test_all_resident_int4_decode_takes_the_resident_shapes(tmp_path: Path, monkeypatch) -> None:
    """Every expert resident, int4, the fused kernels, recorded steps: one-token steps run RESIDENT_CONFIGS'
    shape (codes as words); the same tokens with the int4 kernels launched programmatically
    (common/kernels/pdl.py, the default) and without; with the scalar CUDA down, the tokens of the byte
    form's shapes (DECODE_CONFIGS)."""
    from common.kernels import moe_int4
    from common.kernels.config import DECODE_CONFIGS, KERNELS, RESIDENT_CONFIGS, KernelConfig
    from common.model.fused_kernels import use_fused_kernels

    shape = {"hidden_size": 256, "moe_intermediate_size": 128, "num_experts": 32}
    path = make_model(tmp_path / "m", preset="tiny", arch="qwen3_moe", overrides=shape)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (6, 23)]
    calls = []
    plain = moe_int4.moe_int4_decode

    def spy(*args, **kwargs):
        calls.append(kwargs.get("config"))
        return plain(*args, **kwargs)

    monkeypatch.setattr(moe_int4, "moe_int4_decode", spy)

    def run(kernels: KernelConfig = KERNELS) -> list[list[int]]:
        engine = Engine(
            WorkerConfig(
                str(path),
                dtype="bfloat16",
                device="cuda",
                max_running=1,
                expert_cache="all",
                expert_format="int4",
                cuda_graphs=True,
                kernels=kernels,
            )
        )
        engine.offload.load_all(release_host=False)
        use_fused_kernels(engine.model, True, engine.runner.backend)
        assert engine.offload.fused_int4 and engine.offload.all_resident
        return [r.token_ids for r in engine.generate(prompts, GREEDY)]

    resident = run()
    assert calls and all(c is RESIDENT_CONFIGS[1] for c in calls)
    assert run(replace(KERNELS, pdl=False)) == resident  # every kernel launched plainly: the same tokens
    # the tensor-core down takes its activations in bf16 (as the HF reference computes them), the other
    # forms in fp32: greedy tokens of a random model part after a few steps, so the byte form is compared
    # with the scalar CUDA down, and the tensor-core down with the dequantised reference in test_moe_int4_cuda
    scalar_down = replace(RESIDENT_CONFIGS[1], native_down_mma=False)
    fp32_activations = run(replace(KERNELS, int4_resident={**RESIDENT_CONFIGS, 1: scalar_down}))
    assert run(replace(KERNELS, int4_resident=DECODE_CONFIGS)) == fp32_activations
