"""Offline cache simulation: replay a routing trace against every policy and against two references.

The policies are the real `CacheTables`, driven on CPU tensors token by token, layer by layer, as decode
drives them.

- `belady`: Belady's offline optimum over ONE pool of the same total experts shared by all layers, a lower
  bound for any policy. A step requests one (token, layer)'s experts together; its hits are never evicted for
  its misses; a miss may bypass the pool (as `lfu-admit`). Ties in next use are broken by the uses after it
  (`future_ranks`); tests check it by exhaustive search.
- `oracle-static`: per layer, the experts most used over the trace, each loaded at first use and kept.

Adaptive rows (`<policy>+adaptive`): per-layer capacity rebalanced as the runtime does
(`CacheTables.rebalance` every `OffloadedExperts.rebalance_every` tokens); other rows keep capacities equal.
Steady-state figures count the tokens after the first `warmup` (default: 10 % of the trace).
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import numpy as np
import torch

from common.experts.cache_tables import DEFAULT_POLICY, POLICIES, CacheTables
from common.experts.trace import RoutingTrace
from common.progress import progress

REFERENCES = ("belady", "oracle-static")
ADAPTIVE = "+adaptive"
"""Suffix of a row whose policy runs with adaptive per-layer capacity."""


def slots_per_layer(capacity: float, num_experts: int) -> int:
    """Cache slots per layer for a capacity given as a fraction of each layer's experts (at least one)."""
    if not 0.0 < capacity <= 1.0:
        raise ValueError(f"capacity {capacity} is not a fraction in (0, 1]")
    return max(1, round(capacity * num_experts))


def rebalance_every() -> int:
    """Decode passes between two capacity adjustments: the runtime's own constant."""
    from common.experts.offload import OffloadedExperts  # lazily: the simulator needs only this constant

    return OffloadedExperts.rebalance_every


def rebalance_step(tables: CacheTables) -> int:
    """Slots one adjustment moves: as `OffloadedExperts.begin_pass` computes them."""
    return max(1, tables.num_slots // tables.num_layers // 16)


def default_warmup(trace: RoutingTrace) -> int:
    """Tokens excluded from the steady-state figures by default: the first 10 % of the trace."""
    return trace.num_tokens // 10


def simulate(
    trace: RoutingTrace,
    capacity: float,
    policies: Sequence[str] = POLICIES,
    warmup: int | None = None,
    workers: int | None = None,
    adaptive: Sequence[str] = (DEFAULT_POLICY,),
) -> dict:
    """Misses of each policy, of each policy in `adaptive` with adaptive per-layer capacity (row
    `<policy>+adaptive`), Belady's optimum and the static oracle on `trace` at `capacity`.

    Returns {"accesses", "misses": {name: n}, "warmup_tokens", "steady": {"accesses", "misses"}}; the
    steady figures cover the tokens after the first `warmup_tokens`. Rows replay in `workers` processes
    (default: one per row on a multi-core machine; 1: all in this process).
    """
    warmup = default_warmup(trace) if warmup is None else warmup
    if not 0 <= warmup <= trace.num_tokens:
        raise ValueError(f"warmup {warmup} is outside [0, {trace.num_tokens}] tokens")
    for policy in (*policies, *adaptive):
        if policy not in POLICIES:
            raise ValueError(f"cache policy {policy!r} is not one of {POLICIES}")
    rows = [*policies, *(p + ADAPTIVE for p in adaptive)]
    slots = slots_per_layer(capacity, trace.num_experts)
    if workers is None:  # all at once: with 3 policies on 2 cores, 3 processes finish before 2 would
        workers = len(rows) if (os.cpu_count() or 1) > 1 else 1
    total, steady = {}, {}
    if workers > 1:
        # Each replay is a long chain of small tensor ops, bound by Python and dispatch overhead (threads
        # would serialise on the GIL): replay policies in processes, Belady's in this one meanwhile. Forked,
        # so that callers need no `__main__` guard (spawn re-imports the main script); a forked child must
        # not enter the parent's OpenMP pool (it would wait forever on threads it does not have), so the
        # initializer makes its torch single-threaded before it runs any op.
        fork = get_context("fork")
        with ProcessPoolExecutor(
            workers, mp_context=fork, initializer=torch.set_num_threads, initargs=(1,)
        ) as pool:
            # Ship the ids as a numpy copy: pickling a tensor would move its storage into shared memory
            # in the queue's feeder thread while this thread reads it (torch's multiprocessing reductions).
            ids = trace.ids.numpy().copy()
            args = (ids, trace.num_experts, slots, warmup)
            jobs = {p: pool.submit(_replay_ids, *args, p) for p in rows}
            total["belady"], steady["belady"] = belady_misses(trace, slots * trace.num_layers, warmup)
            for policy, job in progress(jobs.items(), "replaying", total=len(jobs), unit="policy"):
                total[policy], steady[policy] = job.result()
    else:
        for row in rows:
            total[row], steady[row] = replay_policy(trace, row, slots, warmup)
        total["belady"], steady["belady"] = belady_misses(trace, slots * trace.num_layers, warmup)
    total["oracle-static"], steady["oracle-static"] = oracle_static_misses(trace, slots, warmup)
    order = [*rows, *REFERENCES]  # a stable key order for tables and JSON
    total, steady = {n: total[n] for n in order}, {n: steady[n] for n in order}
    per_token = trace.num_layers * trace.top_k
    return {
        "accesses": trace.num_tokens * per_token,
        "misses": total,
        "warmup_tokens": warmup,
        "steady": {"accesses": (trace.num_tokens - warmup) * per_token, "misses": steady},
    }


def replay_policy(
    trace: RoutingTrace, policy: str, slots: int, warmup: int, on_rebalance=None
) -> tuple[int, int]:
    """(all misses, misses after `warmup` tokens) of a fresh `CacheTables` under `policy` (a policy, or
    `<policy>+adaptive`: then capacity is rebalanced before every `rebalance_every()`-th token, as the
    runtime's `begin_pass` does before that decode pass; `on_rebalance(tables)` is called after each)."""
    policy, adapt = policy.removesuffix(ADAPTIVE), policy.endswith(ADAPTIVE)
    tables = CacheTables(trace.num_layers, trace.num_experts, [slots] * trace.num_layers, policy, "cpu")
    every = rebalance_every() if adapt else 0
    before, threads = 0, torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only add overhead (and contend with the other replays)
    try:
        with torch.inference_mode():
            for token in range(trace.num_tokens):
                if token == warmup:  # the only host read of the counters before the end
                    before = int(tables.counters["misses"].sum())
                if every and (token + 1) % every == 0:  # decode pass token + 1 (passes count from 1)
                    tables.rebalance(slots_to_move=rebalance_step(tables))
                    if on_rebalance is not None:
                        on_rebalance(tables)
                masks = trace.masks(token)
                for layer in range(trace.num_layers):
                    tables.resolve(layer, masks[layer], step=token, max_new=trace.top_k)
    finally:
        torch.set_num_threads(threads)
    total = int(tables.counters["misses"].sum())
    return total, total - (before if warmup < trace.num_tokens else total)


def _replay_ids(ids: np.ndarray, num_experts: int, slots: int, warmup: int, policy: str) -> tuple[int, int]:
    """`replay_policy` in a worker process, on a trace's ids (its weights play no part); `policy` may be
    `<policy>+adaptive`."""
    trace = RoutingTrace(torch.from_numpy(ids), torch.zeros(ids.shape), num_experts)
    return replay_policy(trace, policy, slots, warmup)


def oracle_static_misses(trace: RoutingTrace, slots: int, warmup: int) -> tuple[int, int]:
    """(all misses, misses after `warmup` tokens) of a static cache: each layer's `slots` most used experts
    (over the whole trace), each loaded at its first use and never evicted; every other access misses."""
    ids = trace.ids.long()
    layer = torch.arange(trace.num_layers)[None, :, None].expand_as(ids)
    flat = (layer * trace.num_experts + ids).reshape(trace.num_tokens, -1)  # [tokens, layers * top_k]
    size = trace.num_layers * trace.num_experts
    counts = torch.bincount(flat.reshape(-1), minlength=size).view(trace.num_layers, -1)
    chosen = torch.zeros(trace.num_layers, trace.num_experts, dtype=torch.bool)
    chosen.scatter_(1, torch.topk(counts, min(slots, trace.num_experts), dim=1).indices, True)
    miss = ~chosen.view(-1)[flat]
    # The cache starts empty, as every other row's does: a chosen expert's first use is a miss too.
    _, first = np.unique(flat.reshape(-1).numpy(), return_index=True)
    miss.view(-1)[torch.from_numpy(first)] = True
    return int(miss.sum()), int(miss[warmup:].sum())


def next_access(keys: np.ndarray) -> np.ndarray:
    """For each access (flat, in time order), the index of the next access to the same key; len(keys) if
    there is none."""
    order = np.argsort(keys, kind="stable")  # by key, then time
    succ = np.full(keys.shape, len(keys), dtype=np.int64)
    same = keys[order[1:]] == keys[order[:-1]]
    succ[order[:-1][same]] = order[1:][same]
    return succ


def future_ranks(keys: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """For each access, the rank of its key's future after it: the positions of the key's later accesses,
    compared lexicographically (nearest next use first; a key with no later access ranks last).

    Plain next use is not enough when a step requests several keys: two keys next used by the same step tie,
    yet the one used again sooner after it is the better to keep (at that step the kept one is a hit and must
    stay, for free if it is used again soon). Ranks by prefix doubling along each key's chain of accesses
    (as for suffix arrays), until the order stops refining.
    """
    n = len(keys)
    succ = next_access(keys)
    rank, jump, distinct = positions.astype(np.int64), succ, -1
    while True:
        padded = np.append(rank, rank.max(initial=0) + 1)  # past the end: after everything
        pair = rank * (n + 2) + padded[jump]
        uniq, rank = np.unique(pair, return_inverse=True)
        rank = rank.reshape(-1).astype(np.int64)
        if len(uniq) == distinct:  # no refinement in a round: none in any later one
            break
        distinct, jump = len(uniq), np.append(jump, n)[jump]
    return np.append(rank, len(uniq))[succ]


def belady_misses(trace: RoutingTrace, pool: int, warmup: int) -> tuple[int, int]:
    """(all misses, misses after `warmup` tokens) of Belady's optimum with `pool` shared slots."""
    tokens, layers, k = trace.ids.shape
    keys = (np.arange(layers)[None, :, None] * trace.num_experts + trace.ids.numpy()).reshape(-1)
    steps = tokens * layers  # one step: one (token, layer)'s experts, requested together
    positions = np.repeat(np.arange(steps, dtype=np.int64), k)
    futures = future_ranks(keys, positions).tolist()
    misses = _belady_replay(keys.tolist(), futures, k, pool, warmup * layers)
    return misses[0] + misses[1], misses[1]


def _belady_replay(keys: list[int], futures: list[int], k: int, pool: int, split: int) -> list[int]:
    """Misses [before step `split`, from it on] of the bypassing MIN policy (see the module docstring).

    `futures[i]`: the rank of access i's key's future (`future_ranks`; higher: used later). A max-heap of
    (−future, key) with lazy deletion: an entry is live while its key is cached with that future (a key's
    future ranks only grow, so the value identifies its newest entry).
    """
    cached: dict[int, int] = {}  # key -> future rank
    heap: list[tuple[int, int]] = []
    misses = [0, 0]
    for step in range(len(keys) // k):
        group = keys[step * k : (step + 1) * k]
        news = []
        for key, nxt in zip(group, futures[step * k : (step + 1) * k], strict=True):
            if key in cached:
                cached[key] = nxt
                heapq.heappush(heap, (-nxt, key))
            else:
                news.append((nxt, key))
        if not news:
            continue
        misses[step >= split] += len(news)
        _admit(sorted(news), cached, heap, pool, set(group))
    return misses


def _admit(
    news: list[tuple[int, int]], cached: dict[int, int], heap: list[tuple[int, int]], pool: int, group: set
) -> None:
    """Insert a step's misses, nearest future first, each evicting the cached expert with the farthest
    future (never one of the step's own) if that is farther than its own; otherwise bypass."""
    held = []  # live entries of this step's experts, set aside so that they are not evicted
    for nxt, key in news:
        if len(cached) >= pool:
            while heap:
                neg, top = heap[0]
                if cached.get(top) != -neg:
                    heapq.heappop(heap)  # stale
                elif top in group:
                    held.append(heapq.heappop(heap))
                else:
                    break
            if not heap or -heap[0][0] <= nxt:
                break  # every later miss is used even later: bypass them all
            del cached[heapq.heappop(heap)[1]]
        cached[key] = nxt
        heapq.heappush(heap, (-nxt, key))
    for entry in held:
        heapq.heappush(heap, entry)


def format_table(result: dict, capacity: float | None = None) -> str:
    """A plain-text table of `simulate`'s result: misses, their ratio to Belady's and the miss rate, over
    the whole trace and in the steady state."""
    steady = result["steady"]
    runs = [(result["misses"], result["accesses"]), (steady["misses"], steady["accesses"])]
    head = f"capacity {capacity:g} of each layer's experts; " if capacity is not None else ""
    lines = [
        f"{head}{result['accesses']} accesses; steady state after {result['warmup_tokens']} tokens: "
        f"{result['steady']['accesses']} accesses",
        f"{'':<18} {'all tokens':^30} {'steady state':^30}",
        f"{'policy':<18}" + f" {'misses':>10} {'÷belady':>9} {'miss rate':>9}" * 2,
    ]
    for name in result["misses"]:
        cells = [f"{m[name]:>10} {_ratio(m[name], m['belady']):>9} {_ratio(m[name], n):>9}" for m, n in runs]
        lines.append(f"{name:<18} " + " ".join(cells))
    return "\n".join(lines)


def _ratio(n: int, d: int) -> str:
    return f"{n / d:.3f}" if d else "-"
