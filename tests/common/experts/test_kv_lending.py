"""KV lending: the bank slots lent at a page limit share no byte with the pages below it, and an engine that
lends its KV pool's idle pages generates exactly what one without lending does, while contexts grow past
stages (slots reclaimed) and sequences finish (slots lent again)."""

from __future__ import annotations

import pytest
import torch

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.experts.kv_lending import KvLending
from common.kv.state import PagedSpec, SlotSpec, StatePool
from common.model.synthetic.checkpoint import make_model
from common.protocol import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def check_disjoint(device: str, pages: int, page_size: int) -> KvLending:
    """Three paged tensors of different page sizes and three expert components of different row sizes: at
    every stage, bytes written to every lent slot's rows leave every page below the limit as it was."""
    specs = [
        {"k": PagedSpec((2, 24), torch.bfloat16), "v": PagedSpec((2, 24), torch.bfloat16)},
        {"state": SlotSpec((3,), torch.float32)},
        {"keys": PagedSpec((5,), torch.float32)},
    ]
    lending = KvLending(specs, pages, page_size, device)
    components = {"w": ((96, 80), torch.uint8), "s": ((96, 3), torch.bfloat16), "z": ((7,), torch.uint8)}
    main, extra = 13, 1 + 4  # slots before the bank; the spare row and staging rows after it
    bank = lending.bank_size(components, main)
    assert bank > 0
    pool = lending.expert_pool(components, main + bank + extra, main, bank)
    first = lending.first_page
    for limit in lending.stages:
        kv = [t.view(torch.uint8) for layer in lending.paged for t in layer.values()]
        for t in kv:
            t[:limit].fill_(0xAA)
        lent = main + (first >= limit).nonzero().flatten()
        for t in pool.values():
            t.view(t.shape[0], -1).view(torch.uint8)[lent.to(device)] = 0x55
        for t in kv:
            assert bool((t[:limit] == 0xAA).all()), limit
    assert int((first >= lending.stages[0]).sum()) >= bank // 2  # most are lent at the first stage
    for t in kv:  # and the aliasing is real: the whole bank written over the whole pool shows in it
        t.fill_(0xAA)
    for t in pool.values():
        t.view(t.shape[0], -1).view(torch.uint8)[main : main + bank] = 0x55
    shared = sum(int((t == 0x55).sum()) for t in kv)
    assert shared >= lending.memory.shared_bytes // 2
    StatePool(specs, pages, page_size, 2, device, paged=lending.paged)  # the pool takes them as they are
    return lending


def test_lent_slots_share_no_byte_with_the_pages_in_use() -> None:
    check_disjoint("cpu", pages=64, page_size=16)


ARCHS = {"qwen3_moe": {}, "qwen4_exp": {"indexer_n_heads": 16, "indexer_budget": 8}}


@pytest.fixture(scope="module", params=list(ARCHS))
def model(request, tmp_path_factory):
    arch = request.param
    path = make_model(tmp_path_factory.mktemp(arch), preset="tiny", arch=arch, overrides=ARCHS[arch], seed=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (200, 150, 40, 230, 9)]
    reference = Engine(WorkerConfig(str(path), max_running=2, max_context=256)).generate(prompts, GREEDY)
    return path, prompts, [r.token_ids for r in reference]


def run_lending(
    path, prompts, device: str = "cpu", max_seqs: int = 2, max_context: int = 256
) -> tuple[list[list[int]], Engine]:
    """By default two lanes of 256 tokens (stages of 64 tokens): prompts of up to 230 tokens push the limit
    up, finished ones let it down; the cache has one slot a layer of its own."""
    layers = len(Engine(WorkerConfig(str(path), max_running=1)).config.moe_layers)
    engine = Engine(
        WorkerConfig(
            str(path),
            device=device,
            max_running=max_seqs,
            max_context=max_context,
            expert_cache=str(layers),
            lend_kv=True,
        )
    )
    lending = engine.kv_lending
    assert engine.offload.tables.lent > 0 and lending.limit == lending.stages[0]
    out = [r.token_ids for r in engine.generate(prompts, GREEDY)]
    engine.offload.tables.check()
    assert lending.raises > 0 and lending.lowers > 0  # slots reclaimed as contexts grew, lent again after
    assert engine.runner.pool.pages.high_water() == 0 and lending.limit <= lending.stages[1]
    return out, engine


def test_lending_generates_what_no_lending_does(model) -> None:
    path, prompts, reference = model
    out, _ = run_lending(path, prompts)
    assert out == reference


def test_lending_needs_an_expert_cache(model) -> None:
    path, _, _ = model
    with pytest.raises(ValueError, match="needs an expert cache"):
        Engine(WorkerConfig(str(path), max_running=1, lend_kv=True))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_growth_prefills_and_releases_keep_logits_and_tables(model, seed) -> None:
    """Random prompts (prefills), decode steps and releases on three lanes of 256 tokens, in lockstep on a
    lending engine and on one with the same cache that lends nothing: every pass's logits are equal; after
    every pass the tables are consistent, no page in use is at or above the limit and no lent slot lies
    below it."""
    import random

    path, _, _ = model
    layers = len(Engine(WorkerConfig(str(path), max_running=1)).config.moe_layers)
    kwargs = {"max_running": 3, "max_context": 256, "expert_cache": str(layers)}
    plain, lend = (
        Engine(WorkerConfig(str(path), **kwargs)),
        Engine(WorkerConfig(str(path), **kwargs, lend_kv=True)),
    )
    lending, tables = lend.kv_lending, lend.offload.tables
    rng, live = random.Random(seed), []  # [(plain seq, lending seq, tokens so far)]

    def check() -> None:
        tables.check()
        assert lend.runner.pool.pages.high_water() <= lending.limit
        lent = tables.lent_mask[tables.bank].cpu()
        assert bool((lending.first_page[lent] >= lending.limit).all())

    def run(pairs: list, tokens: list[list[int]]) -> None:
        want = plain.runner.forward([p[0] for p in pairs], tokens)
        got = lend.runner.forward([p[1] for p in pairs], tokens)
        assert torch.equal(got, want)
        for pair, toks in zip(pairs, tokens, strict=True):
            pair[2] += len(toks)
        check()

    for _ in range(40):
        roll = rng.random()
        if len(live) < 3 and roll < 0.35:
            pair = [plain.runner.new_sequence(), lend.runner.new_sequence(), 0]
            live.append(pair)
            run([pair], [[rng.randrange(3, 1000) for _ in range(rng.randint(1, 150))]])
        elif live and roll < 0.5:
            pair = live.pop(rng.randrange(len(live)))
            plain.runner.release(pair[0])
            lend.runner.release(pair[1])
            check()
        elif live:
            for pair in [p for p in live if p[2] >= 250]:  # at the context's end: done
                live.remove(pair)
                plain.runner.release(pair[0])
                lend.runner.release(pair[1])
            if live:
                run(live, [[rng.randrange(3, 1000)] for _ in live])
    for pair in live:
        plain.runner.release(pair[0])
        lend.runner.release(pair[1])
        check()
    assert lending.raises > 0 and lending.limit <= lending.stages[1]


def test_a_warm_up_may_take_lent_pages_back(model) -> None:
    """A freeze with no other reader (`untracked`, a benchmark's warm-up) does not block growth: a prompt
    past the first stage takes its pages back from the cache, and the tables stay consistent."""
    path, prompts, _ = model
    layers = len(Engine(WorkerConfig(str(path), max_running=1)).config.moe_layers)
    engine = Engine(
        WorkerConfig(str(path), max_running=2, max_context=256, expert_cache=str(layers), lend_kv=True)
    )
    with engine.offload.untracked():
        seq = engine.runner.new_sequence()
        engine.runner.forward([seq], [prompts[0]])  # 200 tokens: 13 pages, past the first stage's 4
        engine.runner.release(seq)
    assert engine.kv_lending.raises == 1
    engine.offload.tables.check()
