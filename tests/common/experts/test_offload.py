"""Experts served from the host store through the VRAM cache and the prefill arena change nothing: generated
tokens are identical to the all-resident model for every capacity, policy, prefill chunk size and format."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.experts.cache_tables import CacheTables
from common.experts.copies import copy_experts
from common.experts.formats import get_format
from common.experts.offload import OffloadedExperts, parse_capacity
from common.experts.prefill_path import PrefillArena
from common.experts.store import HostExpertStore
from common.kernels.config import KERNELS
from common.model.resident import batched_expert_mlp, grouped_expert_mlp
from common.model.synthetic.checkpoint import make_model
from common.protocol import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ARCHS = {
    "qwen3_moe": {},
    "qwen2_moe": {},  # shared expert, a dense layer
    "qwen4_exp": {"indexer_n_heads": 16, "indexer_budget": 8},
}


@pytest.fixture(scope="module", params=list(ARCHS))
def model(request, tmp_path_factory):
    arch = request.param
    path = make_model(tmp_path_factory.mktemp(arch), preset="tiny", arch=arch, overrides=ARCHS[arch], seed=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (6, 23, 15)]
    reference = Engine(WorkerConfig(str(path), max_running=3)).generate(prompts, GREEDY)
    return path, prompts, [r.token_ids for r in reference]


def _run(path, prompts, **kwargs) -> tuple[list[list[int]], Engine]:
    engine = Engine(WorkerConfig(str(path), max_running=2, **kwargs))
    out = [r.token_ids for r in engine.generate(prompts, GREEDY)]
    engine.offload.tables.check()
    return out, engine


def _smallest(path) -> str:
    engine = Engine(WorkerConfig(str(path), max_running=1))
    return str(len(engine.config.moe_layers))  # one slot per MoE layer


@pytest.mark.parametrize("policy", ["lru", "lfu", "lfu-admit"])
def test_identical_for_every_capacity_and_chunk(model, policy):
    path, prompts, reference = model
    for capacity, chunk in itertools.product([_smallest(path), "0.25", "0.5", "all"], [1, 5, 8192]):
        out, engine = _run(path, prompts, expert_cache=capacity, cache_policy=policy, prefill_chunk=chunk)
        assert out == reference, (capacity, chunk)
        counters = {k: int(v.sum()) for k, v in engine.offload.tables.counters.items()}
        if capacity == "all":
            assert counters["bypasses"] == 0 and counters["evictions"] == 0


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_quantized_formats_identical_across_capacities(model, fmt):
    path, prompts, _ = model
    if fmt == "int4" and "qwen2" in str(path):
        pytest.skip("qwen2_moe's tiny expert width (32) is not a multiple of int4's 128-wide groups")
    try:
        baseline, _ = _run(path, prompts, expert_cache="all", expert_format=fmt)
    except ValueError as exc:  # int4 needs hidden and expert widths that are multiples of 128
        pytest.skip(str(exc))
    for capacity in [_smallest(path), "0.5"]:
        out, _ = _run(path, prompts, expert_cache=capacity, expert_format=fmt, prefill_chunk=4)
        assert out == baseline, capacity


def test_record_then_replay_reproduces_the_run(model, tmp_path):
    path, prompts, reference = model
    engine = Engine(WorkerConfig(str(path), max_running=3, record_routing=True))
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == reference
    trace = engine.routing_recorder.trace()
    trace.save(tmp_path / "trace.safetensors")
    replayed = Engine(
        WorkerConfig(str(path), max_running=3, replay_routing=str(tmp_path / "trace.safetensors"))
    )
    assert [r.token_ids for r in replayed.generate(prompts, GREEDY)] == reference


def test_synthetic_zipf_replay_is_deterministic_and_forces_routing(model):
    path, prompts, reference = model
    runs = [
        Engine(
            WorkerConfig(str(path), max_running=3, replay_routing="synthetic-zipf:seed=5,tokens=64")
        ).generate(prompts, GREEDY)
        for _ in range(2)
    ]
    assert [r.token_ids for r in runs[0]] == [r.token_ids for r in runs[1]]
    assert [r.token_ids for r in runs[0]] != reference


def test_parse_capacity():
    assert parse_capacity("all", 3, 8) == [8, 8, 8]
    assert parse_capacity("0.25", 3, 8) == [2, 2, 2]
    assert parse_capacity("7", 3, 8) == [3, 2, 2]
    assert parse_capacity("100", 3, 8) == [8, 8, 8]
    for bad in ["2", "0.0", "1.5", "lots"]:
        with pytest.raises(ValueError):
            parse_capacity(bad, 3, 8)


def test_all_experts_loaded_up_front_serve_without_misses(model):
    path, prompts, reference = model
    engine = Engine(WorkerConfig(str(path), max_running=2, expert_cache="all"))
    engine.offload.load_all()
    assert int(engine.offload.store.buffer.count_nonzero()) == 0  # the host copy was given back
    before = engine.offload.traffic()
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == reference
    after = engine.offload.traffic()
    assert after == before and all(int(v.sum()) == 0 for v in engine.offload.tables.counters.values())
    engine.offload.tables.check()
    with pytest.raises(ValueError, match="slots per layer"):
        Engine(WorkerConfig(str(path), max_running=1, expert_cache="0.5")).offload.load_all()


def test_pinned_hot_set_stays_and_changes_nothing(model, tmp_path):
    path, prompts, reference = model
    hot = tmp_path / "hot.json"
    hot.write_text('{"0": [1, 2], "1": [7]}')
    out, engine = _run(path, prompts, expert_cache="0.25", pin_experts=str(hot))
    assert out == reference
    tables = engine.offload.tables
    assert sorted(tables.owner[tables.pinned].tolist()) == [1, 2, 7]


def test_adaptive_capacity_moves_slots_and_changes_nothing(model):
    path, prompts, reference = model
    engine = Engine(WorkerConfig(str(path), max_running=2, expert_cache="0.5"))
    engine.offload.rebalance_every = 2  # adjust often
    before = engine.offload.tables.capacities
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == reference
    engine.offload.tables.check()
    after = engine.offload.tables.capacities
    assert sum(after) == sum(before)


@pytest.mark.parametrize("guess", [2, 6])
def test_lookahead_changes_nothing_and_its_guesses_are_used(model, guess):
    path, prompts, reference = model
    out, engine = _run(path, prompts, expert_cache="0.25", lookahead=guess)
    assert out == reference
    counters = {k: int(v.sum()) for k, v in engine.offload.tables.counters.items()}
    assert 0 < counters["prefetch_hits"] <= counters["prefetches"]
    moved = sum(engine.offload.traffic().prefetch_bytes)
    assert moved == counters["prefetches"] * engine.offload.store.expert_bytes
    with pytest.raises(ValueError, match="expert-cache"):
        Engine(WorkerConfig(str(path), max_running=1, lookahead=guess))
    with pytest.raises(ValueError, match="num_experts"):
        Engine(WorkerConfig(str(path), max_running=1, expert_cache="0.25", lookahead=1000))


def test_the_lookahead_switch_stops_the_guesses(model, monkeypatch):
    """SparseMoeBlock.lookahead off (decode_offload --ablate's no-lookahead): installed, but no guess."""

    path, prompts, reference = model
    out, engine = _run(
        path, prompts, expert_cache="0.25", lookahead=2, kernels=replace(KERNELS, lookahead=False)
    )
    assert out == reference
    assert int(engine.offload.tables.counters["guesses"].sum()) == 0


@pytest.mark.parametrize("chunk", [5, 8192])
def test_lending_the_arena_between_prefills_changes_nothing(model, chunk):
    """Two lanes, three prompts: the third prompt's prefill comes after decode passes, so the lent buffer is
    taken back for it and lent again; rebalancing moves lent slots between layers meanwhile."""
    path, prompts, reference = model
    engine = Engine(
        WorkerConfig(str(path), max_running=2, expert_cache="0.25", prefill_chunk=chunk, lend_arena=True)
    )
    engine.offload.rebalance_every = 3
    tables, calls = engine.offload.tables, []
    for name in ("lend", "reclaim"):
        method = getattr(tables, name)
        setattr(tables, name, lambda method=method, name=name: (calls.append((name, tables.lent)), method()))
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == reference
    tables.check()
    assert tables.lent == tables.bank.numel() == engine.config.num_experts  # a decode pass came last
    lends = [lent for name, lent in calls if name == "lend" and lent == 0]
    reclaims = [lent for name, lent in calls if name == "reclaim" and lent > 0]
    assert len(lends) >= 2 and len(reclaims) >= 1  # lent, taken back for the third prefill, lent again


@pytest.mark.parametrize("kv_dtype", [None, "fp8_e4m3"])
def test_a_warm_up_leaves_no_trace(model, kv_dtype):
    """`ModelRunner.warm_up` (run by the workers on CUDA before their first request) changes no table, no
    counter and no lane of the real pool, and the engine then generates what a fresh one does."""
    path, prompts, reference = model
    engine = Engine(WorkerConfig(str(path), max_running=2, expert_cache="0.25", kv_dtype=kv_dtype))
    tables, provider = engine.offload.tables, engine.offload
    names = ("slot_of", "owner", "last_use", "pinned", "freq", "absent", "previous", "reuse", "counts")
    before = {n: getattr(tables, n).clone() for n in (*names, "slot_table")}
    moved, step, free = provider._moved.clone(), provider.step.clone(), engine.runner.pool.slots.num_free
    engine.runner.warm_up(tokens=9)
    assert all(torch.equal(getattr(tables, n), t) for n, t in before.items())
    assert torch.equal(provider._moved, moved) and torch.equal(provider.step, step) and not tables.frozen
    assert engine.runner.pool.slots.num_free == free
    if kv_dtype is None:
        assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == reference
    else:  # fp8 K/V: the same tokens as an engine that was not warmed up
        fresh = Engine(WorkerConfig(str(path), max_running=2, expert_cache="0.25", kv_dtype=kv_dtype))
        want = [r.token_ids for r in fresh.generate(prompts, GREEDY)]
        assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == want


# --- the provider on its own: fixed-shape copies, staging rows, batched decode, whole-layer streaming ----

E, LAYERS, TOP_K = 8, 3, 2


@pytest.fixture(scope="module", params=["bf16", "fp8", "int4"])
def store(request) -> HostExpertStore:
    """A store of random experts (H = I = 128: every format's sizes work)."""
    fmt = get_format(request.param)
    store = HostExpertStore(LAYERS, E, fmt.components(128, 128), map_for_gpu=False)
    g = torch.Generator().manual_seed(3)
    for layer in range(LAYERS):
        weights = [(torch.randn(256, 128, generator=g), torch.randn(128, 128, generator=g)) for _ in range(E)]
        store.fill(layer, [fmt.pack(gu * 0.05, d * 0.05) for gu, d in weights])
    store.fmt = fmt
    return store


def _provider(store: HostExpertStore, capacity: int, policy: str = "lfu-admit") -> OffloadedExperts:
    tables = CacheTables(LAYERS, E, [capacity] * LAYERS, policy)
    return OffloadedExperts(store, tables, store.fmt, F.silu, list(range(LAYERS)), "cpu", torch.float32)


def _routing(steps: int, tokens: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per step: x [T, H], topk_ids [T, k] (distinct per token), topk_weights [T, k]."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(tokens)])
        out.append((torch.randn(tokens, 128, generator=g), ids, torch.rand(tokens, TOP_K, generator=g)))
    return out


def _reference(store: HostExpertStore, layer: int, x, ids, weights) -> torch.Tensor:
    gate_up, down = store.fmt.unpack_many(store.parts[layer], torch.float32)  # [E, 2I, H], [E, H, I]
    return batched_expert_mlp(x, gate_up[ids], down[ids], ids, weights, F.silu)


def _random_rows(block: torch.Tensor, rows: int, g: torch.Generator) -> torch.Tensor:
    """[rows, ...] of block's row shape and dtype, random bytes."""
    row_bytes = block[0].numel() * block.element_size()
    raw = torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, generator=g)
    return raw.view(block.dtype).view(rows, *block.shape[1:])


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1).view(torch.uint8)


def test_copy_experts_moves_only_valid_pairs(store):
    parts, rows, spare = store.parts[1], 12, 11
    g = torch.Generator().manual_seed(1)
    pool = {n: _random_rows(b, rows, g) for n, b in parts.items()}
    some = torch.rand(5, generator=g) < 0.5
    for valid in (torch.zeros(5, dtype=torch.bool), torch.ones(5, dtype=torch.bool), some):
        before = {n: t.clone() for n, t in pool.items()}
        src, dst = torch.randperm(E, generator=g)[:5], torch.randperm(spare, generator=g)[:5]
        copy_experts(parts, src, dst, valid, pool, spare)
        untouched = torch.ones(rows, dtype=torch.bool)
        untouched[dst[valid]] = False
        untouched[spare] = False  # the only row an invalid pair may write
        for n, t in pool.items():
            assert torch.equal(_as_bytes(t)[untouched], _as_bytes(before[n])[untouched]), n
            assert torch.equal(_as_bytes(t)[dst[valid]], _as_bytes(parts[n])[src[valid]]), n


@pytest.mark.parametrize("policy", ["lru", "lfu", "lfu-admit"])
def test_decode_identical_for_every_capacity(store, policy):
    steps = _routing(steps=6, tokens=3)
    for capacity in (1, 3, E):
        provider = _provider(store, capacity, policy)
        for x, ids, weights in steps:
            provider.begin_pass(True)
            for layer in range(LAYERS):
                out = provider.forward(layer, x, ids, weights)
                assert torch.equal(out, _reference(store, layer, x, ids, weights)), (capacity, layer)
        provider.tables.check()
        traffic = provider.traffic()
        stats = {n: int(c.sum()) for n, c in provider.tables.counters.items()}
        assert sum(traffic.cache_bytes) == (stats["misses"] - stats["bypasses"]) * store.expert_bytes
        assert sum(traffic.bypass_bytes) == stats["bypasses"] * store.expert_bytes
        if capacity == 1 and policy == "lfu-admit":
            assert stats["bypasses"] > 0  # bypassed experts were read from their staging rows


class RefuseSyncs(TorchFunctionMode):
    """Every tensor op of the block, checked: no host read of a tensor's values, no data-dependent shape, no
    boolean-mask indexing, no assignment of a Python scalar (on CUDA, each a host synchronization). A mode,
    not patched methods: a `__getitem__` set on torch.Tensor stays a sequence slot for the whole process (it
    made every later `torch.tensor([0-d tensor])` fail)."""

    REFUSED = frozenset(
        [getattr(torch.Tensor, n) for n in ("tolist", "item", "nonzero", "unique", "argwhere")]
        + [getattr(torch.Tensor, n) for n in ("__bool__", "__int__", "__float__")]
        + [torch.nonzero, torch.unique, torch.bincount, torch.argwhere, torch.masked_select]
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.REFUSED:
            raise AssertionError(f"host sync in a decode step: {func.__name__}")
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
                raise AssertionError("boolean-mask indexing (a nonzero) in a decode step")
            if func is torch.Tensor.__setitem__ and not isinstance(args[2], torch.Tensor):
                raise AssertionError("assignment of a Python scalar (a sync on CUDA) in a decode step")
        return func(*args, **(kwargs or {}))


def test_decode_step_never_syncs(store):
    """Structurally: nothing in a decode forward (fills, bypasses, evictions, lookahead included) syncs."""
    provider = _provider(store, 2, "lru")
    steps = _routing(steps=3, tokens=4, seed=5)
    provider.begin_pass(True)
    provider.forward(0, *steps[0])  # fill the cache first, so the checked steps evict
    t = torch.zeros(4)
    with RefuseSyncs():
        for sync in (
            lambda: t.sum().item(),
            lambda: t[t > 0],
            lambda: t.__setitem__(0, 1.0),
            lambda: bool(t[0]),
        ):
            with pytest.raises(AssertionError, match="decode step"):  # the check sees each kind
                sync()
        for x, ids, weights in steps[1:]:
            provider.begin_pass(True)
            for layer in range(LAYERS):
                provider.forward(layer, x, ids, weights)
                if layer + 1 < LAYERS:  # a lookahead's guess (the next layer's own choices, shifted)
                    provider.lookahead(layer + 1, x, lambda x, ids=ids: (ids + 1) % E)
    counters = provider.tables.counters
    assert int(counters["evictions"].sum()) > 0 and int(counters["misses"].sum()) > 0
    assert int(counters["prefetches"].sum()) > 0


def test_lookahead_copies_only_the_layers_whose_guesses_pay(store):
    """Every `rebalance_every` passes a layer's guess precision switches its copies: layer 1 guesses its
    experts right, layer 2 wrong (it keeps guessing, measured, but copies nothing), until it guesses right."""
    provider = _provider(store, 3, "lru")
    provider.rebalance_every = 2
    steps = _routing(steps=16, tokens=2, seed=9)
    for s, (x, ids, weights) in enumerate(steps):
        provider.begin_pass(True)
        wrong = s < 8
        for layer in range(LAYERS):
            prepared = provider.prepare(layer, ids)
            if layer + 1 < LAYERS:
                others = torch.tensor([[e for e in range(E) if e not in ids]])  # [1, n]: all wrong
                guess = others if layer + 1 == 2 and wrong else ids
                provider.lookahead(layer + 1, x, lambda x, guess=guess: guess)
            out = provider.compute(layer, prepared, x, ids, weights)
            assert torch.equal(out, _reference(store, layer, x, ids, weights))
        if s == 7:
            assert provider.tables.guessing.tolist() == [True, True, False]
            prefetched = int(provider.tables.counters["prefetches"][2])
    assert provider.tables.guessing.tolist() == [True, True, True]  # right again: copies again
    counters = provider.tables.counters
    assert int(counters["prefetches"][2]) > prefetched and int(counters["guesses"][2]) > 0
    provider.tables.check()


def test_lookahead_is_first_gated_after_first_gate_passes(store):
    """A layer that guesses at chance stops copying after `first_gate` passes, long before the first
    rebalance; one that guesses right goes on."""
    provider = _provider(store, 3, "lru")
    provider.rebalance_every, provider.first_gate = 1000, 3
    for s, (x, ids, weights) in enumerate(_routing(steps=5, tokens=1, seed=4)):
        provider.begin_pass(True)
        assert provider.tables.guessing.tolist() == (
            [True] * 3 if s < 2 else [True, True, False]
        )  # gated at pass 3
        for layer in range(LAYERS):
            prepared = provider.prepare(layer, ids)
            if layer + 1 < LAYERS:
                wrong = torch.tensor([[e for e in range(E) if e not in ids]])
                guess = wrong if layer + 1 == 2 else ids
                provider.lookahead(layer + 1, x, lambda x, guess=guess: guess)
            provider.compute(layer, prepared, x, ids, weights)
    provider.tables.check()


def _prefill(provider: OffloadedExperts, x, ids, weights) -> list[torch.Tensor]:
    provider.begin_pass(False)
    return [provider.forward(layer, x, ids, weights) for layer in range(LAYERS)]


def test_big_chunks_stream_whole_layers(store):
    (x, ids, weights), *decode = _routing(steps=3, tokens=4 * E // TOP_K, seed=7)  # T·k = 4·E: whole layers
    provider = _provider(store, 3)
    for step in decode:  # warm the cache: a big chunk streams its layers whole all the same
        provider.begin_pass(True)
        for layer in range(LAYERS):
            provider.forward(layer, *step)
    before = provider.traffic()
    out = _prefill(provider, x, ids, weights)
    traffic = provider.traffic()
    loads = [a - b for a, b in zip(traffic.arena_loads, before.arena_loads, strict=True)]
    moved = [
        (a - b) // store.expert_bytes for a, b in zip(traffic.arena_bytes, before.arena_bytes, strict=True)
    ]
    assert loads == [1] * LAYERS and moved == [E] * LAYERS  # each layer once, every expert of it
    for layer, o in enumerate(out):
        assert torch.equal(o, _grouped_reference(store, layer, x, ids, weights)), layer

    lazy = _provider(store, 3)
    lazy.arena.prefetch_factor = float("inf")  # cached experts in place, the others after routing
    for step in decode:
        lazy.begin_pass(True)
        for layer in range(LAYERS):
            lazy.forward(layer, *step)
    before = lazy.traffic()
    assert all(torch.equal(a, b) for a, b in zip(_prefill(lazy, x, ids, weights), out, strict=True))
    uncached = [int((lazy.tables.slot_of[i, :E] < 0).sum()) for i in range(LAYERS)]
    after = lazy.traffic()
    moved = [
        (a - b) // store.expert_bytes for a, b in zip(after.arena_bytes, before.arena_bytes, strict=True)
    ]
    assert all(0 < m <= u for m, u in zip(moved, uncached, strict=True))  # what was requested, not cached


def test_big_chunks_do_not_read_the_cache(store):
    """A whole-layer pass reads only its buffers: a cached expert evicted behind its back (as another
    process's decode could) changes nothing."""
    (x, ids, weights), warm = _routing(steps=2, tokens=4 * E // TOP_K, seed=9)
    provider = _provider(store, 3, "lru")
    provider.begin_pass(True)
    for layer in range(LAYERS):
        provider.forward(layer, *warm)
    provider.begin_pass(False)
    provider.forward(0, x, ids, weights)  # launches layer 1's copy
    tables = provider.tables
    slots = tables.layer_slots[1]
    gone = tables.owner[slots[0]].clone()
    tables.slot_of[1, gone], tables.owner[slots[0]] = -1, -1
    assert torch.equal(provider.forward(1, x, ids, weights), _grouped_reference(store, 1, x, ids, weights))


def _grouped_reference(store: HostExpertStore, layer: int, x, ids, weights) -> torch.Tensor:
    def weights_of(e: int):
        return store.fmt.unpack(store.expert(layer, e), torch.float32)

    return grouped_expert_mlp(x, weights_of, ids, weights, F.silu)


def test_batched_expert_mlp_matches_grouped(store):
    for x, ids, weights in _routing(steps=2, tokens=5, seed=11):
        batched = _reference(store, 0, x, ids, weights)
        torch.testing.assert_close(
            batched, _grouped_reference(store, 0, x, ids, weights), rtol=1e-5, atol=1e-6
        )


def test_whole_layer_streaming_in_the_engine_changes_nothing(model, monkeypatch):
    path, prompts, reference = model
    decisions = []
    should = PrefillArena.should_prefetch
    monkeypatch.setattr(
        PrefillArena, "should_prefetch", lambda a, c: decisions.append(should(a, c)) or decisions[-1]
    )
    out, _ = _run(path, prompts, expert_cache=_smallest(path), prefill_chunk=8192)
    assert out == reference and any(decisions) and not all(decisions)


def test_a_warm_up_after_lending_takes_the_arena_back_first(model):
    path, prompts, reference = model
    engine = Engine(WorkerConfig(str(path), max_running=2, expert_cache="0.25", lend_arena=True))
    assert [r.token_ids for r in engine.generate(prompts[:1], GREEDY)] == reference[:1]
    assert engine.offload.tables.lent  # a decode pass came last
    engine.runner.warm_up(tokens=9)
    engine.offload.tables.check()
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == reference


def test_a_prefill_counts_its_routing_in_the_cache_statistics(model):
    """Decode's rates start from the prompt's routing: after a prefill the request statistics are those of
    its tokens taken as steps (the recorded choices observed by fresh tables), and no slot moved."""
    path, prompts, _ = model
    engine = Engine(WorkerConfig(str(path), max_running=1, expert_cache="0.5", record_routing=True))
    tables = engine.offload.tables
    slots = tables.slot_of.clone()
    engine.runner.forward([engine.runner.new_sequence()], [prompts[1]])
    trace = engine.routing_recorder.trace()  # [T, L, k] of the prompt
    fresh = CacheTables(tables.num_layers, tables.num_experts, tables.capacities, "lfu-admit", "cpu")
    for layer in range(tables.num_layers):
        fresh.observe(layer, trace.ids[:, layer].long())
    assert trace.num_tokens == len(prompts[1]) and float(tables.freq.sum()) > 0
    for name in ("freq", "absent", "reuse", "previous", "observed"):
        assert torch.equal(getattr(tables, name), getattr(fresh, name)), name
    assert torch.equal(tables.slot_of, slots)


def test_kv_calibration_counts_nothing(model):
    """fp8 K/V scales come from a pass of random tokens at load: not a prompt, so no statistic moves."""
    path, _, _ = model
    engine = Engine(WorkerConfig(str(path), max_running=1, expert_cache="0.5", kv_dtype="fp8_e4m3"))
    assert float(engine.offload.tables.statistics().abs().sum()) == 0.0
