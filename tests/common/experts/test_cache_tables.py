"""CacheTables under random traces: invariants after every step, what a Resolution promises, pinning,
rebalancing, and the policies' defining behaviour on hand-made patterns."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.experts.cache_tables import POLICIES, CacheTables
from common.experts.trace import synthetic_zipf


@st.composite
def scenarios(draw):
    """A small cache configuration and a random request trace for it."""
    layers = draw(st.integers(1, 3))
    experts = draw(st.integers(2, 10))
    top_k = draw(st.integers(1, min(4, experts)))
    all_fit = draw(st.booleans())
    capacities = [experts if all_fit else draw(st.integers(1, experts)) for _ in range(layers)]
    pinned = {}
    for layer in range(layers):
        n = draw(st.integers(0, capacities[layer] if draw(st.booleans()) else 0))
        if n:
            pinned[layer] = draw(st.permutations(range(experts)))[:n]
    steps = draw(st.integers(1, 25))
    trace = [
        [draw(st.sets(st.integers(0, experts - 1), max_size=top_k)) for _ in range(layers)]
        for _ in range(steps)
    ]
    return {
        "layers": layers,
        "experts": experts,
        "top_k": top_k,
        "capacities": capacities,
        "pinned": pinned,
        "trace": trace,
        "policy": draw(st.sampled_from(POLICIES)),
        "decay": draw(st.sampled_from([0.5, 0.98, 0.9995, 1.0])),
        "rebalance_every": draw(st.sampled_from([0, 1, 3])),
    }


def _mask(experts: int, chosen) -> torch.Tensor:
    mask = torch.zeros(experts, dtype=torch.bool)
    mask[list(chosen)] = True
    return mask


def _check_rows_and_copies(tables: CacheTables, requested: torch.Tensor, res, max_new: int) -> None:
    """Every requested expert has a pool row (its slot or its own staging row) and the fixed-shape copy list
    pairs each miss, once, with that row; padding targets the spare row."""
    e, spare = tables.num_experts, tables.num_slots
    kept = res.slot >= 0
    assert res.row.shape == (e,) and res.row.dtype == torch.int64
    assert torch.equal(res.row[kept], res.slot[kept])
    bypassed = int(res.bypass.sum())  # the j-th bypass, in expert order, gets staging row S+1+j
    assert torch.equal(res.row[res.bypass], torch.arange(tables.staging_base, tables.staging_base + bypassed))
    assert (res.row[~requested] == spare).all() and (res.row < tables.num_rows).all()
    p = min(max_new, e)
    assert res.newcomer.shape == res.target.shape == res.valid.shape == (p,)
    misses = (res.filled | res.bypass).nonzero().squeeze(1)
    assert sorted(res.newcomer[res.valid].tolist()) == misses.tolist()
    assert torch.equal(res.target[res.valid], res.row[res.newcomer[res.valid]])
    assert (res.target[~res.valid] == spare).all()
    assert ((res.newcomer >= 0) & (res.newcomer < e)).all()  # padding reads a real host row


def _check_step(tables: CacheTables, layer: int, requested: torch.Tensor, res, before: dict) -> None:
    """What a Resolution promises, against the tables before and after the step."""
    e = tables.num_experts
    was = before["slot_of"][layer, :e]
    hit, miss = requested & (was >= 0), requested & (was < 0)
    filled, bypass, slot = res.filled, res.bypass, res.slot
    assert filled.shape == bypass.shape == slot.shape == (e,)
    # requested = hits ∪ filled ∪ bypassed, disjointly; filled and bypassed are misses
    assert torch.equal(requested, hit | filled | bypass)
    assert not (filled & bypass).any() and not (filled & ~miss).any() and not (bypass & ~miss).any()
    # hits keep their slot; filled experts got a slot of this layer, owned by them; others have none
    assert torch.equal(slot[hit], was[hit])
    assert (slot[filled] >= 0).all() and (slot[~(hit | filled)] == -1).all()
    assert torch.equal(slot[hit | filled], tables.slot_of[layer, :e][hit | filled])
    assert torch.equal(tables.owner[slot[filled]], filled.nonzero().squeeze(1))
    layer_slots = set(tables.layer_slots[layer].tolist())
    assert set(slot[filled].tolist()) <= layer_slots
    # a slot a hit used is never a victim; pinned slots never change hands
    assert not set(slot[filled].tolist()) & set(was[hit].tolist())
    assert torch.equal(tables.owner[tables.pinned], before["owner"][tables.pinned])
    # the counters count this step
    for name, n in (("hits", hit), ("misses", miss), ("bypasses", bypass)):
        assert int(tables.counters[name][layer] - before[name][layer]) == int(n.sum())
    # without an admission test, every miss that can get a slot gets one
    free_or_evictable = (
        len(layer_slots) - int(tables.pinned[tables.layer_slots[layer]].sum()) - int(hit.sum())
    )
    pinned_hits = int((tables.pinned[was[hit]]).sum())
    if tables.policy != "lfu-admit":
        assert int(filled.sum()) == min(int(miss.sum()), free_or_evictable + pinned_hits)
    # free slots go first: evictions only for the misses that found none
    free = int((before["owner"][tables.layer_slots[layer]] < 0).sum())
    evictions = int(tables.counters["evictions"][layer] - before["evictions"][layer])
    assert evictions == max(0, int(filled.sum()) - free)


def _snapshot(tables: CacheTables) -> dict:
    snap = {n: c.clone() for n, c in tables.counters.items()}
    return snap | {"slot_of": tables.slot_of.clone(), "owner": tables.owner.clone()}


@settings(max_examples=120, deadline=None)
@given(scenarios())
def test_random_traces_keep_invariants(sc) -> None:
    tables = CacheTables(
        sc["layers"], sc["experts"], sc["capacities"], sc["policy"], decay=sc["decay"], pinned=sc["pinned"]
    )
    tables.check()
    pinned_slots = {layer: tables.slot_of[layer, list(ids)].clone() for layer, ids in sc["pinned"].items()}
    for step, requests in enumerate(sc["trace"]):
        for layer, chosen in enumerate(requests):
            requested = _mask(sc["experts"], chosen)
            before = _snapshot(tables)
            res = tables.resolve(layer, requested, step, max_new=sc["top_k"])
            tables.check()
            _check_step(tables, layer, requested, res, before)
            _check_rows_and_copies(tables, requested, res, sc["top_k"])
        if sc["rebalance_every"] and step % sc["rebalance_every"] == 0:
            tables.rebalance(slots_to_move=1 + step % 2)
            tables.check()
            assert all(c >= 1 for c in tables.capacities)
        for layer, ids in sc["pinned"].items():  # pinned experts never leave their slots
            assert torch.equal(tables.slot_of[layer, list(ids)], pinned_slots[layer])


def _serve_step(tables: CacheTables, sc: dict, step: int, requests: list) -> None:
    """One trace step through every layer (rows and copies checked), the scenario's rebalancing, and the
    tables' invariants after it."""
    for layer, chosen in enumerate(requests):
        res = tables.resolve(layer, _mask(sc["experts"], chosen), step, max_new=sc["top_k"])
        _check_rows_and_copies(tables, _mask(sc["experts"], chosen), res, sc["top_k"])
    if sc["rebalance_every"] and step % sc["rebalance_every"] == 0:
        tables.rebalance(slots_to_move=1 + step % 2)
    tables.check()


@settings(max_examples=60, deadline=None)
@given(scenarios(), st.integers(1, 12), st.integers(2, 5))
def test_lending_and_reclaiming_keep_the_tables_consistent(sc, bank: int, every: int) -> None:
    """The bank's slots lent to the layers and taken back at random points of a trace (with rebalancing):
    the tables stay consistent, a reclaimed slot holds nothing and no layer lists it, pinned experts stay."""
    tables = CacheTables(
        sc["layers"], sc["experts"], sc["capacities"], sc["policy"], decay=sc["decay"], pinned=sc["pinned"],
        lendable=bank,
    )  # fmt: skip
    pinned_slots = {layer: tables.slot_of[layer, list(ids)].clone() for layer, ids in sc["pinned"].items()}
    for step, requests in enumerate(sc["trace"]):
        if step % every == 0:
            if tables.lent:
                tables.reclaim()
                listed = torch.cat(tables.layer_slots)
                assert not bool(torch.isin(listed, tables.bank).any())
                if not sc["pinned"]:  # rebalancing gave a layer's own slots away: reclaim leaves it one
                    assert min(tables.capacities) >= 1
            else:
                room = sc["layers"] * sc["experts"] - sum(tables.capacities)
                tables.lend()
                assert tables.lent == min(bank, room)
            tables.check()
        _serve_step(tables, sc, step, requests)
        for layer, ids in sc["pinned"].items():
            assert torch.equal(tables.slot_of[layer, list(ids)], pinned_slots[layer])


@settings(max_examples=60, deadline=None)
@given(scenarios(), st.integers(1, 12), st.randoms(use_true_random=False))
def test_lending_and_reclaiming_parts_of_the_bank(sc, bank: int, rng) -> None:
    """KV lending's form: random subsets of the bank lent and taken back at random steps (with rebalancing):
    the lent set is what was lent less what was taken back (as far as the layers had room), a slot taken back
    holds nothing and no layer lists it, and the tables stay consistent."""
    tables = CacheTables(
        sc["layers"], sc["experts"], sc["capacities"], sc["policy"], decay=sc["decay"], lendable=bank
    )
    lent: set[int] = set()
    for step, requests in enumerate(sc["trace"]):
        part = [s for s in tables.bank.tolist() if rng.random() < 0.5]
        if rng.random() < 0.5:
            room = sc["layers"] * sc["experts"] - sum(tables.capacities)
            fresh = [s for s in part if s not in lent]
            tables.lend(torch.tensor(part, dtype=torch.int64))
            lent |= set(fresh[:room])
        else:
            tables.reclaim(torch.tensor(part, dtype=torch.int64))
            lent -= set(part)
            listed = set(torch.cat(tables.layer_slots).tolist())
            assert not listed & set(part) and all(int(tables.owner[s]) == -1 for s in part)
        assert set(tables.bank[tables.lent_mask[tables.bank]].tolist()) == lent and tables.lent == len(lent)
        tables.check()
        _serve_step(tables, sc, step, requests)


@settings(max_examples=60, deadline=None)
@given(scenarios())
def test_capacity_all_second_access_hits(sc) -> None:
    e = sc["experts"]
    tables = CacheTables(sc["layers"], e, [e] * sc["layers"], sc["policy"], decay=sc["decay"])
    seen: set[tuple[int, int]] = set()
    for step, requests in enumerate(sc["trace"]):
        for layer, chosen in enumerate(requests):
            res = tables.resolve(layer, _mask(e, chosen), step, max_new=sc["top_k"])
            for expert in chosen:
                hit = not bool(res.filled[expert]) and not bool(res.bypass[expert])
                assert hit == ((layer, expert) in seen), (layer, expert, step)
                seen.add((layer, expert))
    assert int(tables.counters["evictions"].sum()) == 0 and int(tables.counters["bypasses"].sum()) == 0


def _run(tables: CacheTables, sequence: list[int], layer: int = 0) -> list[bool]:
    """Serve one expert per step; return whether each step was a hit."""
    hits = []
    for step, expert in enumerate(sequence):
        before = int(tables.counters["hits"][layer])
        tables.resolve(layer, _mask(tables.num_experts, [expert]), step, max_new=1)
        hits.append(int(tables.counters["hits"][layer]) > before)
    return hits


def test_lru_cycle_longer_than_capacity_always_misses() -> None:
    tables = CacheTables(1, 8, [3], "lru")
    assert not any(_run(tables, [0, 1, 2, 3] * 6))  # each expert was evicted just before its turn


def test_lru_cycle_within_capacity_hits_after_first_round() -> None:
    tables = CacheTables(1, 8, [4], "lru")
    assert _run(tables, [0, 1, 2, 3] * 5) == [False] * 4 + [True] * 16


def test_lru_evicts_least_recently_used() -> None:
    tables = CacheTables(1, 8, [3], "lru")
    _run(tables, [0, 1, 2, 0, 3])  # 1 is the least recently used when 3 arrives
    assert tables.slot_of[0, 1] == -1 and all(tables.slot_of[0, e] >= 0 for e in (0, 2, 3))


@pytest.mark.parametrize("policy", ["lfu", "lfu-admit"])
def test_lfu_keeps_the_frequent_expert_through_a_scan(policy: str) -> None:
    # Expert 0 every third step, one-off experts in between, two slots.
    sequence = [x for i in range(1, 30) for x in (0, 2 * i, 2 * i + 1)]
    hits = _run(CacheTables(1, 64, [2], policy, decay=1.0), sequence)
    # from its third use on, 0 always hits (at first, 0 and a one-off both have one fresh request)
    assert all(hits[6::3]) and not any(hits[1::3] + hits[2::3])
    assert not any(_run(CacheTables(1, 64, [2], "lru"), sequence))  # the scan flushes 0 out of LRU


def test_lfu_ties_go_to_the_least_recently_used() -> None:
    tables = CacheTables(1, 8, [3], "lfu", decay=1.0)
    _run(tables, [5, 6, 7, 4])  # equal rates: 5 is the least recently used
    assert tables.slot_of[0, 5] == -1 and all(tables.slot_of[0, e] >= 0 for e in (6, 7, 4))


def test_admission_bypasses_a_rare_newcomer_without_reuse() -> None:
    # With no step-to-step reuse, a one-off expert does not displace an expert chosen at half the steps.
    tables = CacheTables(1, 64, [1], "lfu-admit", decay=1.0)
    sequence = [x for i in range(1, 20) for x in (0, i)]
    hits = _run(tables, sequence)
    assert all(hits[2::2]) and int(tables.counters["bypasses"][0]) == 19


def test_resolve_does_not_sync_shapes() -> None:
    # Fixed shapes whatever the outcome: every field is [E], however many hits and misses there were.
    tables = CacheTables(2, 16, [4, 4], "lfu-admit")
    for step in range(6):
        for layer in range(2):
            res = tables.resolve(layer, _mask(16, range(step, step + 3)), step, max_new=3)
            assert res.slot.shape == res.filled.shape == res.bypass.shape == res.row.shape == (16,)
            assert res.newcomer.shape == res.target.shape == res.valid.shape == (3,)


def test_bypasses_get_staging_rows_in_expert_order() -> None:
    # One slot, no reuse: with 0 cached and frequent, the newcomers 5 and 3 are bypassed, not admitted.
    tables = CacheTables(1, 8, [1], "lfu-admit", decay=1.0)
    for step in range(4):
        tables.resolve(0, _mask(8, [0] if step % 2 else [0, step + 1]), step, max_new=2)
    res = tables.resolve(0, _mask(8, [0, 3, 5]), 4, max_new=3)
    assert res.bypass.nonzero().squeeze(1).tolist() == [3, 5]
    base = tables.staging_base
    assert res.row[[0, 3, 5]].tolist() == [0, base, base + 1]
    assert res.valid.tolist() == [True, True, False]
    assert sorted(zip(res.newcomer[:2].tolist(), res.target[:2].tolist(), strict=True)) == [
        (3, base),
        (5, base + 1),
    ]
    assert res.target[2] == tables.num_slots


def test_a_group_never_evicts_what_the_group_before_it_requested() -> None:
    """A grouped pass: group 1's miss takes a slot the earlier group's step did not request, even where the
    policy ranks that one first (its expert the rarest)."""
    tables = CacheTables(1, 16, [4], "lfu", decay=1.0)
    for step, chosen in enumerate([[0, 1, 2, 3], [], [1, 2, 3], [], [1, 2, 3]], start=1):
        tables.resolve(0, _mask(16, chosen), step, max_new=4)  # 0 the rarest of the four cached
    tables.resolve(0, _mask(16, [0]), 6, max_new=1, group=0, groups=2)
    res = tables.resolve(0, _mask(16, [9]), 6, max_new=1, group=1, groups=2)
    assert res.valid.tolist() == [True] and tables.slot_of[0, 9] >= 0
    assert tables.slot_of[0, 0] >= 0 and tables.slot_of[0, 1] == -1  # 9 took 1's slot, not 0's
    tables.check()
    alone = CacheTables(1, 16, [4], "lfu", decay=1.0)  # ungrouped, 0 requested by no one this step
    for step, chosen in enumerate([[0, 1, 2, 3], [], [1, 2, 3], [], [1, 2, 3], [9]], start=1):
        alone.resolve(0, _mask(16, chosen), step, max_new=4)
    assert alone.slot_of[0, 0] == -1


def test_regrouping_starts_every_group_from_the_last_pass() -> None:
    """After ungrouped passes, a grouped pass's groups start from the last pass's requests (not a grouped
    pass's long gone): here LRU keeps 7 and 8, requested by the last pass, and evicts 1 and 2, which group 1
    requested four passes before; and back to one group, the previous step is both groups' requests."""
    tables = CacheTables(1, 16, [4], "lru")
    tables.regroup(2)
    tables.resolve(0, _mask(16, [0]), 1, max_new=2, group=0, groups=2)
    tables.resolve(0, _mask(16, [1, 2]), 1, max_new=2, group=1, groups=2)
    tables.regroup(1)
    assert tables.previous[0, 0].nonzero().squeeze(1).tolist() == [0, 1, 2]
    for step in range(2, 5):
        tables.resolve(0, _mask(16, [7, 8]), step, max_new=2)
    tables.regroup(2)
    tables.resolve(0, _mask(16, [5, 6]), 5, max_new=2, group=0, groups=2)
    cached = (tables.slot_of[0, :16] >= 0).nonzero().squeeze(1).tolist()
    assert cached == [5, 6, 7, 8]
    tables.check()


def test_groups_keep_their_own_previous_step_and_staging_rows() -> None:
    """Each group's step is fresh against its own previous step, and its bypasses take its half of the
    staging rows."""
    tables = CacheTables(1, 8, [1], "lfu-admit", decay=1.0)
    tables.resolve(0, _mask(8, [0]), 1, max_new=2, group=0, groups=2)
    tables.resolve(0, _mask(8, [0]), 1, max_new=2, group=1, groups=2)
    assert tables.previous[:, 0].sum(1).tolist() == [1, 1]
    assert tables.freq[0, 0] == 2  # each group's first request of 0 is fresh
    tables.resolve(0, _mask(8, [0]), 2, max_new=2, group=0, groups=2)
    assert tables.freq[0, 0] == 2  # a repeat of group 0's previous step
    for step in range(3, 6):  # 0 frequent, no room: newcomers bypass
        tables.resolve(0, _mask(8, [0]), step, max_new=2, group=0, groups=2)
    res = tables.resolve(0, _mask(8, [0, 3, 5]), 6, max_new=3, group=1, groups=2)
    base = tables.staging_base + 8 // 2
    assert res.bypass.nonzero().squeeze(1).tolist() == [3, 5]
    assert res.row[[3, 5]].tolist() == [base, base + 1]


def _serve(tables: CacheTables, steps: int, chosen_by_layer) -> None:
    for step in range(steps):
        for layer, chosen in enumerate(chosen_by_layer(step)):
            tables.resolve(layer, _mask(tables.num_experts, chosen), step, max_new=len(chosen) or 1)


@pytest.mark.parametrize("policy", POLICIES)
def test_rebalance_moves_slots_to_the_layer_a_slot_is_worth_most_to(policy: str) -> None:
    # Layer 0 uses experts 0 and 1 at every step (two of its four slots stay free); layer 1 cycles through
    # 8 experts: slots are worth nothing to layer 0 and an eighth of a request per step to layer 1.
    tables = CacheTables(2, 16, [4, 4], policy, decay=1.0)
    _serve(tables, 64, lambda step: [[0, 1], [step % 8]])
    assert tables.rebalance(slots_to_move=1) == [(0, 1, 2)]  # both free slots, chunk by chunk
    tables.check()
    assert tables.capacities == [2, 6] and all(tables.slot_of[0, e] >= 0 for e in (0, 1))
    _serve(tables, 64, lambda step: [[0, 1], [step % 8]])
    # Now a slot of layer 0 serves half its requests (worth 1 a step), one more of layer 1's an eighth: stay.
    assert tables.rebalance(slots_to_move=1) == []
    assert tables.capacities == [2, 6]


def test_rebalance_water_fills_over_several_layers() -> None:
    # Layers 0 and 1 each need 2 of their 6 slots; layers 2 and 3 cycle through 10 experts.
    tables = CacheTables(4, 16, [6, 6, 6, 6], "lfu-admit", decay=1.0)
    _serve(tables, 80, lambda step: [[0, 1], [2, 3], [step % 10], [(step + 5) % 10]])
    moves = tables.rebalance(slots_to_move=2)
    tables.check()
    assert sum(tables.capacities) == 24 and tables.capacities[:2] == [2, 2]
    assert {d for d, _, _ in moves} == {0, 1} and {r for _, r, _ in moves} == {2, 3}
    assert sorted(tables.capacities[2:]) == [10, 10]


def test_rebalance_waits_while_frozen_and_keeps_pinned_and_min_slots() -> None:
    tables = CacheTables(2, 16, [4, 4], "lfu", decay=1.0, pinned={0: [0, 1, 2]})
    _serve(tables, 40, lambda step: [[0], [step % 8]])
    tables.frozen = True
    assert tables.rebalance(slots_to_move=4) == []
    tables.frozen = False
    assert tables.rebalance(slots_to_move=4, min_slots=1) == [(0, 1, 1)]  # only the unpinned slot moves
    tables.check()
    assert tables.capacities == [3, 5] and bool(tables.pinned[tables.layer_slots[0]].all())


def test_reclaim_leaves_every_layer_a_slot() -> None:
    """A layer lent bank slots gives its own slot away to rebalancing (it holds a cold expert, the other
    layer's misses are hot); taking the bank back must leave it a slot, not none (every miss would bypass)."""
    tables = CacheTables(2, 10, [1, 1], "lfu", lendable=10)
    tables.lend()
    tables.resolve(0, _mask(10, [9]), 0, max_new=3)  # the cold expert: into layer 0's own slot (free, first)
    for step in range(1, 11):
        tables.resolve(0, _mask(10, [step % 5]), step, max_new=3)
        tables.resolve(1, _mask(10, [step % 10, (step + 1) % 10, (step + 2) % 10]), step, max_new=3)
    assert tables.rebalance(slots_to_move=1) == [(0, 1, 1)]
    assert not bool(torch.isin(tables.layer_slots[0], tables.bank, invert=True).any())  # only lent ones
    tables.reclaim()
    assert tables.capacities == [1, 1]
    tables.check()


@pytest.mark.parametrize("tokens", [1, 7, 2500])  # one step; fewer than a slice; several slices
def test_observing_a_prompt_adds_its_tokens_as_steps(tokens: int) -> None:
    """`observe` adds to the request statistics what `_count` for each prompt token in turn gives fresh
    tables (no decay among a prompt's tokens: two passes add up to one), after decode steps already
    counted, and leaves decode's previous step, slots and recency alone."""
    trace = synthetic_zipf(layers=2, experts=64, top_k=4, tokens=tokens + 5, seed=3)
    decoded, whole, split = (CacheTables(2, 64, [8, 8], "lfu-admit", "cpu", decay=0.99) for _ in range(3))
    for tables in (decoded, whole, split):
        for t in range(5):  # decode steps before the prompt
            for layer in range(2):
                tables.resolve(layer, trace.masks(t)[layer], step=t, max_new=4)
    prompt = CacheTables(2, 64, [8, 8], "lfu-admit", "cpu", decay=1.0)  # the prompt alone, step by step
    for t in range(5, tokens + 5):
        for layer in range(2):
            prompt._count(layer, trace.masks(t)[layer])
    cut = tokens // 2
    for layer in range(2):
        ids = trace.ids[5:, layer].long()
        whole.observe(layer, ids)
        split.observe(layer, ids[:cut])
        split.observe(layer, ids[cut:])
    for tables in (whole, split):
        torch.testing.assert_close(tables.statistics(), decoded.statistics() + prompt.statistics())
        for name in ("previous", "slot_of", "owner", "last_use"):
            assert torch.equal(getattr(tables, name), getattr(decoded, name)), name
        assert torch.equal(tables.observed, prompt.previous[0])


def test_prefetch_fills_guessed_experts_that_the_step_then_hits() -> None:
    tables = CacheTables(1, 16, [4], "lru")
    tables.resolve(0, _mask(16, [0, 1, 2]), 1, max_new=3)  # three of four slots
    stats = tables.statistics().clone()
    newcomer, target, valid = tables.prefetch(0, _mask(16, [1, 5, 6]), 2, max_new=3)
    assert sorted(newcomer[valid].tolist()) == [5, 6]  # 1 is cached already
    assert tables.slot_of[0, 1] >= 0, "a guessed expert that is cached is not evicted for the others"
    assert torch.equal(target[valid], tables.slot_of[0, newcomer[valid]])
    assert torch.equal(tables.statistics(), stats), "a guess is not a request"
    assert int(tables.counters["prefetches"][0]) == 2 and int(tables.counters["misses"][0]) == 3
    res = tables.resolve(0, _mask(16, [1, 5]), 3, max_new=2)
    assert not bool(res.valid.any())  # both hits
    assert int(tables.counters["prefetch_hits"][0]) == 1  # 5; 1 was cached by a step, not a guess
    tables.resolve(0, _mask(16, [5]), 4, max_new=1)
    assert int(tables.counters["prefetch_hits"][0]) == 1  # counted once
    tables.check()


def test_prefetch_does_nothing_while_frozen() -> None:
    tables = CacheTables(1, 16, [4], "lfu-admit")
    tables.resolve(0, _mask(16, [0, 1]), 1, max_new=2)
    owner = tables.owner.clone()
    tables.frozen = True
    _, _, valid = tables.prefetch(0, _mask(16, [7, 8]), 2, max_new=2)
    assert not bool(valid.any()) and torch.equal(tables.owner, owner)


def test_guesses_are_measured_whether_or_not_they_are_copied() -> None:
    tables = CacheTables(1, 16, [4], "lru")
    tables.guessing[0] = False
    _, _, valid = tables.prefetch(0, _mask(16, [3, 4, 5]), 1, max_new=3)
    assert not bool(valid.any()) and bool((tables.owner < 0).all())  # recorded, not copied
    tables.resolve(0, _mask(16, [4, 7]), 2, max_new=2)
    assert int(tables.counters["guesses"][0]) == 3 and int(tables.counters["guesses_used"][0]) == 1
    assert not bool(tables.predicted.any()), "a guess is compared with one step only"
    tables.resolve(0, _mask(16, [3]), 3, max_new=1)
    assert int(tables.counters["guesses_used"][0]) == 1
