"""The cache simulator: Belady's optimum is optimal and a lower bound, the static oracle, the result's shape,
the policy target on synthetic-zipf, and the `spillway simulate` command."""

from __future__ import annotations

import json
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.experts.cache_tables import DEFAULT_POLICY, POLICIES
from common.experts.simulator import (
    ADAPTIVE,
    REFERENCES,
    belady_misses,
    format_table,
    future_ranks,
    next_access,
    oracle_static_misses,
    rebalance_every,
    rebalance_step,
    replay_policy,
    simulate,
    slots_per_layer,
)
from common.experts.trace import RoutingTrace, synthetic_zipf

ROOT = Path(__file__).resolve().parents[3]
# A reduced standard trace: the standard's statistics (s over [0.6, 1.2], reuse 0.3, 512 experts, top-10,
# 4096 tokens) over 4 layers instead of 48. Measured at 30 %: lfu-admit 22.1 % fewer misses than lru
# (seeds 0-2: 22.0-22.9 %) and 1.68× Belady's, against 23.2 % and 1.66× on the full standard trace; fewer
# tokens would not do (2048 tokens: 20.5 %), the frequency estimates need the time.
REDUCED = dict(layers=4, tokens=4096)
ROWS = (*POLICIES, DEFAULT_POLICY + ADAPTIVE, *REFERENCES)


@st.composite
def traces(draw, max_layers: int = 3, max_experts: int = 8, max_tokens: int = 24) -> RoutingTrace:
    """A random trace: each (token, layer) chooses top_k distinct experts."""
    layers = draw(st.integers(1, max_layers))
    experts = draw(st.integers(2, max_experts))
    top_k = draw(st.integers(1, min(3, experts)))
    tokens = draw(st.integers(1, max_tokens))
    rows = [
        draw(st.permutations(range(experts)))[:top_k]
        for _ in range(tokens * layers)  # token-major, like the trace
    ]
    ids = torch.tensor(rows, dtype=torch.int32).view(tokens, layers, top_k)
    return RoutingTrace(ids, torch.full(ids.shape, 1.0 / top_k), experts)


def _brute_force_optimum(trace: RoutingTrace, pool: int) -> int:
    """Fewest misses over every schedule of Belady's model (shared pool, a step's hits kept, bypass allowed)
    by exhaustive search over the pool's contents. Keeping more never hurts (an expert can be dropped at any
    later step), so each step keeps as many as fit."""
    groups = [
        frozenset((layer, int(e)) for e in trace.ids[t, layer])
        for t in range(trace.num_tokens)
        for layer in range(trace.num_layers)
    ]
    states = {frozenset(): 0}
    for group in groups:
        nxt: dict[frozenset, int] = {}
        for held, cost in states.items():
            hits = held & group
            cost += len(group - held)
            rest = (held | group) - hits
            for keep in combinations(sorted(rest), min(pool - len(hits), len(rest))):
                state = hits | frozenset(keep)
                nxt[state] = min(nxt.get(state, cost), cost)
        states = nxt
    return min(states.values())


@settings(max_examples=150, deadline=None)
@given(traces(max_layers=2, max_experts=4, max_tokens=6), st.integers(1, 4))
def test_belady_is_optimal_on_tiny_traces(trace: RoutingTrace, pool: int) -> None:
    assert belady_misses(trace, pool, warmup=0)[0] == _brute_force_optimum(trace, pool)


@settings(max_examples=60, deadline=None)
@given(traces(), st.floats(0.05, 1.0))
def test_belady_is_a_lower_bound(trace: RoutingTrace, capacity: float) -> None:
    result = simulate(trace, capacity, workers=1)
    misses = result["misses"]
    assert set(misses) == set(ROWS)
    for name in (*POLICIES, DEFAULT_POLICY + ADAPTIVE, "oracle-static"):
        assert misses["belady"] <= misses[name], name
    # everything misses at least once per distinct (layer, expert), at most once per access
    distinct = len(
        {(layer, int(e)) for layer in range(trace.num_layers) for e in trace.ids[:, layer].unique()}
    )
    assert all(distinct <= n <= result["accesses"] for n in misses.values())


def test_next_access_and_future_ranks() -> None:
    keys = np.array([5, 7, 5, 5, 7, 9, 8, 8])
    positions = np.array([0, 0, 1, 2, 3, 3, 4, 5])
    assert next_access(keys).tolist() == [2, 4, 3, 8, 8, 8, 7, 8]
    ranks = future_ranks(keys, positions)
    # futures: 5@0 → (1, 2); 7@0 → (3); 5@1 → (2); 8@4 → (5); the rest: none (last, tied)
    assert ranks[0] < ranks[2] < ranks[1] < ranks[6] < ranks[3] == ranks[4] == ranks[5] == ranks[7]


def test_future_ranks_break_next_use_ties_by_the_use_after() -> None:
    # 1 and 2 are next used together at position 2; 2 is used again at 3, 1 at 4, 0 never again.
    keys = np.array([1, 2, 1, 2, 2, 1])
    positions = np.array([0, 0, 2, 2, 3, 4])
    ranks = future_ranks(keys, positions)
    assert ranks[1] < ranks[0]  # same next use (2): 2's use after it (3) is nearer than 1's (4)


def test_belady_by_hand() -> None:
    # One layer, one expert per token, a pool of 2: A B C A B with Belady evicting (or bypassing) C.
    ids = torch.tensor([0, 1, 2, 0, 1], dtype=torch.int32).view(5, 1, 1)
    trace = RoutingTrace(ids, torch.ones(5, 1, 1), 3)
    assert belady_misses(trace, 2, warmup=0) == (3, 3)
    assert belady_misses(trace, 2, warmup=3) == (3, 0)


def test_oracle_static_by_hand() -> None:
    # Expert 0 is used 3 times, 1 twice, 2 once; one slot keeps expert 0 (loaded at its first use).
    ids = torch.tensor([0, 1, 0, 2, 1, 0], dtype=torch.int32).view(6, 1, 1)
    trace = RoutingTrace(ids, torch.ones(6, 1, 1), 3)
    assert oracle_static_misses(trace, 1, warmup=0) == (4, 4)
    assert oracle_static_misses(trace, 1, warmup=2) == (4, 2)
    assert oracle_static_misses(trace, 3, warmup=0) == (3, 3)


def test_result_shape_and_steady_state() -> None:
    trace = synthetic_zipf(layers=2, experts=32, top_k=4, tokens=100, seed=1)
    result = simulate(trace, 0.25, workers=1)
    assert set(result) == {"accesses", "misses", "warmup_tokens", "steady"}
    assert result["accesses"] == 100 * 2 * 4 and result["warmup_tokens"] == 10
    assert result["steady"]["accesses"] == 90 * 2 * 4
    assert list(result["misses"]) == list(ROWS) == list(result["steady"]["misses"])
    for name, n in result["misses"].items():
        assert 0 < result["steady"]["misses"][name] < n
    whole = simulate(trace, 0.25, warmup=0, workers=1)
    assert whole["steady"]["misses"] == whole["misses"] == result["misses"]
    assert set(simulate(trace, 0.25, warmup=100, workers=1)["steady"]["misses"].values()) == {0}
    assert "belady" in format_table(result, 0.25)


def test_parallel_replay_matches_serial() -> None:
    trace = synthetic_zipf(layers=3, experts=64, top_k=6, tokens=200, seed=2)
    assert simulate(trace, 0.3, workers=3) == simulate(trace, 0.3, workers=1)


def test_parallel_replay_after_threaded_torch() -> None:
    # A forked worker must not wait on the parent's OpenMP pool: use it in the parent first.
    code = (
        "import torch; torch.set_num_threads(2); torch.zeros(8_000_000).add_(1).sum();"
        "from common.experts.trace import synthetic_zipf; from common.experts.simulator import simulate;"
        "print(simulate(synthetic_zipf(layers=4, experts=64, tokens=300), 0.3, workers=2)['accesses'])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(300 * 4 * 10)]


def test_validation() -> None:
    trace = synthetic_zipf(layers=1, experts=16, top_k=2, tokens=10)
    with pytest.raises(ValueError, match="capacity"):
        simulate(trace, 0.0)
    with pytest.raises(ValueError, match="warmup"):
        simulate(trace, 0.5, warmup=11)
    with pytest.raises(ValueError, match="'fifo'"):
        simulate(trace, 0.5, policies=("fifo",))
    with pytest.raises(ValueError, match="'fifo'"):
        simulate(trace, 0.5, adaptive=("fifo",))
    assert (
        slots_per_layer(0.001, 512) == 1 and slots_per_layer(0.3, 512) == 154 and slots_per_layer(1, 8) == 8
    )


def test_adaptive_row_rebalances_as_the_runtime_does() -> None:
    # 600 tokens: rebalanced before tokens 255 and 511 (decode passes 256 and 512), 154 // 16 = 9 slots a
    # chunk. Layers of very different skew: capacity moves, the total stays, and Belady's bounds the row.
    trace = synthetic_zipf(layers=4, experts=512, tokens=600, s_min=0.3, s_max=1.5)
    slots = slots_per_layer(0.3, 512)
    seen = []

    def record(tables) -> None:
        tables.check()
        assert rebalance_step(tables) == 9
        seen.append(tables.capacities)

    adaptive = replay_policy(trace, DEFAULT_POLICY + ADAPTIVE, slots, warmup=0, on_rebalance=record)
    assert rebalance_every() == 256 and len(seen) == 2
    assert all(sum(c) == 4 * slots and min(c) >= 1 for c in seen)
    assert seen[-1] != [slots] * 4  # something moved
    assert belady_misses(trace, 4 * slots, warmup=0)[0] <= adaptive[0]
    fixed = replay_policy(trace, DEFAULT_POLICY, slots, warmup=0)
    result = simulate(trace, 0.3, policies=(DEFAULT_POLICY,), warmup=0, workers=1)
    assert result["misses"][DEFAULT_POLICY + ADAPTIVE] == adaptive[0]
    assert result["misses"][DEFAULT_POLICY] == fixed[0]
    assert result["misses"]["belady"] <= adaptive[0]


def test_adaptive_rows_are_optional() -> None:
    trace = synthetic_zipf(layers=2, experts=32, top_k=4, tokens=50, seed=3)
    assert list(simulate(trace, 0.25, adaptive=(), workers=1)["misses"]) == [*POLICIES, *REFERENCES]
    both = simulate(trace, 0.25, policies=("lru",), adaptive=("lru", "lfu"), workers=1)
    assert list(both["misses"]) == ["lru", "lru" + ADAPTIVE, "lfu" + ADAPTIVE, *REFERENCES]


def _admit_vs_lru(trace: RoutingTrace, capacity: float) -> float:
    misses = simulate(trace, capacity, policies=("lru", "lfu-admit"))["misses"]
    return 1 - misses["lfu-admit"] / misses["lru"]


def test_default_policy_target_on_reduced_trace() -> None:
    assert _admit_vs_lru(synthetic_zipf(**REDUCED), 0.3) >= 0.20


@pytest.mark.slow
def test_default_policy_target_on_standard_trace() -> None:
    assert _admit_vs_lru(synthetic_zipf(), 0.3) >= 0.20  # measured: 0.232 (~35-60 s on 2 cores)


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "services.cli", "simulate", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_cli_json() -> None:
    out = _cli(
        "--trace", "synthetic-zipf:layers=2,experts=32,top_k=4,tokens=60", "--capacity", "0.25", "--json"
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert set(result) == {"accesses", "misses", "warmup_tokens", "steady"}
    assert set(result["misses"]) == set(result["steady"]["misses"]) == set(ROWS)
    assert set(result["steady"]) == {"accesses", "misses"} and result["accesses"] == 60 * 2 * 4


def test_cli_table_and_errors(tmp_path, capsys) -> None:
    from services.cli import main

    path = tmp_path / "t.safetensors"
    synthetic_zipf(layers=2, experts=16, top_k=2, tokens=30).save(path)
    assert main(["simulate", "--trace", str(path), "--capacity", "0.5"]) == 0
    table = capsys.readouterr().out
    assert all(name in table for name in ROWS) and "÷belady" in table
    assert main(["simulate", "--trace", "synthetic-zipf:layer=2", "--capacity", "0.5"]) == 2
    assert "unknown key 'layer'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:  # argparse's refusal, before the trace is read
        main(["simulate", "--trace", str(path), "--capacity", "1.5"])
    assert refused.value.code == 2 and "capacity 1.5 is not a fraction" in capsys.readouterr().err


@pytest.mark.slow
def test_adaptive_capacity_on_standard_trace() -> None:
    # measured: lfu-admit+adaptive 24.5 % fewer misses than lru, lfu-admit 23.2 % (~2-4 min on 2 cores)
    misses = simulate(synthetic_zipf(), 0.3, policies=("lru", "lfu-admit"))["misses"]
    assert misses["lfu-admit" + ADAPTIVE] < misses["lfu-admit"]
    assert 1 - misses["lfu-admit" + ADAPTIVE] / misses["lru"] >= 0.24
