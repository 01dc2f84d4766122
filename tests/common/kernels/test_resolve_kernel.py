"""The one-program cache resolution (common/kernels/resolve.py) against CacheTables.resolve: after every
step of random traces, every table (slots, owners, recency, statistics, counters) is identical, and so are
the pool rows of the requested experts and the copy list — for each policy, with pinned experts, a frozen
cache, rebalancing and lent slots lent and taken back between steps. Without CUDA the kernel runs in
Triton's interpreter (conftest.py)."""

from __future__ import annotations

import itertools

import pytest
import torch

from common.experts.cache_tables import POLICIES, CacheTables

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TABLES = ("slot_of", "owner", "last_use", "freq", "absent", "previous", "reuse", "counts", "slot_table")
TABLES += ("fetched", "predicted", "guessing")


def _pair(policy: str, gen: torch.Generator, layers: int, experts: int) -> tuple[CacheTables, CacheTables]:
    capacities = torch.randint(1, experts + 1, (layers,), generator=gen).tolist()
    hot = torch.randperm(experts, generator=gen)[: capacities[0] // 2].tolist()
    make = lambda: CacheTables(
        layers, experts, capacities, policy, DEVICE, decay=0.98, pinned={0: hot} if hot else None, lendable=5
    )
    return make(), make()


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(3))
def test_kernel_resolution_equals_torch(policy: str, seed: int, groups: int) -> None:
    """`groups` 2: each step resolves every layer once a group, in turn (a grouped decode pass)."""
    from common.kernels.resolve import resolve_step

    gen = torch.Generator().manual_seed(seed + 10 * groups)
    layers, experts, top_k = 3, 16, 3
    reference, fused = _pair(policy, gen, layers, experts)
    moved = torch.zeros(4, layers, dtype=torch.int64, device=DEVICE)
    for step in range(1, 40):
        if step % 13 == 0:  # a frozen stretch: misses bypass
            reference.frozen = fused.frozen = not reference.frozen
        if step % 10 == 0:
            assert reference.rebalance(2) == fused.rebalance(2)
        if step % 7 == 0 and not reference.frozen:  # the bank lent, then taken back
            for tables in (reference, fused):
                if tables.lent:
                    tables.reclaim()
                else:
                    tables.lend()
        tokens = int(torch.randint(1, 4 if groups == 1 else 3, (), generator=gen))  # ≤ E // groups choices
        for layer, group in itertools.product(range(layers), range(groups)):
            ids = torch.randint(0, experts, (tokens, top_k), generator=gen).to(DEVICE)  # repeats: shared use
            requested = torch.zeros(experts, dtype=torch.bool, device=DEVICE)
            requested[ids.reshape(-1)] = True
            stamp = torch.tensor(step, device=DEVICE)
            max_new = min(ids.numel(), experts)
            want = reference.resolve(layer, requested, stamp, max_new, group, groups)
            row, newcomer, target, valid = resolve_step(
                fused, layer, ids, stamp, moved, group=group, groups=groups
            )
            for name in TABLES:
                got, expected = getattr(fused, name), getattr(reference, name)
                if name == "last_use":  # the torch path also stamps the spare slot (its stamp means nothing)
                    got, expected = got[:-1], expected[:-1]
                assert torch.equal(got, expected), (step, layer, name)
            assert torch.equal(row[requested], want.row[requested]), (step, layer)
            assert torch.equal(valid, want.valid) and torch.equal(target, want.target), (step, layer)
            assert torch.equal(newcomer[valid], want.newcomer[want.valid]), (step, layer)
        fused.check()
    assert moved[0].sum() + moved[1].sum() == fused.counters["misses"].sum()  # every miss: filled or bypassed


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(2))
def test_kernel_prefetch_equals_torch(policy: str, seed: int) -> None:
    """Lookahead guesses before each layer's step (half of them right), a frozen stretch, lending: the
    prefetch program's tables and copy lists equal CacheTables.prefetch's, and the resolutions after it too
    (prefetch hits counted alike)."""
    from common.kernels.resolve import prefetch_step, resolve_step

    gen = torch.Generator().manual_seed(100 + seed)
    layers, experts, top_k, guess = 3, 16, 3, 4
    reference, fused = _pair(policy, gen, layers, experts)
    moved = torch.zeros(4, layers, dtype=torch.int64, device=DEVICE)
    for step in range(1, 30):
        if step % 11 == 0:
            reference.frozen = fused.frozen = not reference.frozen
        if step % 7 == 0 and not reference.frozen:
            for tables in (reference, fused):
                tables.reclaim() if tables.lent else tables.lend()
        if step % 5 == 0:  # a layer's guesses gated off, then on again: recorded, not copied
            for tables in (reference, fused):
                tables.guessing[1] = not bool(tables.guessing[1])
        tokens = int(torch.randint(1, 3, (), generator=gen))
        stamp = torch.tensor(step, device=DEVICE)
        for layer in range(layers):
            ids = torch.randint(0, experts, (tokens, top_k), generator=gen)
            wrong = torch.randint(0, experts, (tokens, guess - 2), generator=gen)
            guessed = torch.cat([ids[:, :2], wrong], dim=1).to(DEVICE)  # [T, guess]
            ids = ids.to(DEVICE)
            predicted = torch.zeros(experts, dtype=torch.bool, device=DEVICE)
            predicted[guessed.reshape(-1)] = True
            budget = guessed.numel()
            want = reference.prefetch(layer, predicted, stamp, budget)
            got = prefetch_step(fused, layer, guessed, stamp, budget)
            assert torch.equal(got[2], want[2]) and torch.equal(got[1], want[1]), (step, layer)
            assert torch.equal(got[0][got[2]], want[0][want[2]]), (step, layer)
            requested = torch.zeros(experts, dtype=torch.bool, device=DEVICE)
            requested[ids.reshape(-1)] = True
            reference.resolve(layer, requested, stamp, max_new=min(ids.numel(), experts))
            resolve_step(fused, layer, ids, stamp, moved)
            for name in TABLES:
                got_t, expected = getattr(fused, name), getattr(reference, name)
                if name == "last_use":
                    got_t, expected = got_t[:-1], expected[:-1]
                assert torch.equal(got_t, expected), (step, layer, name)
        fused.check()
    assert 0 < fused.counters["prefetch_hits"].sum() <= fused.counters["prefetches"].sum()
    assert 0 < fused.counters["guesses_used"].sum() < fused.counters["guesses"].sum()
