"""The expert cache's resolution of one layer's decode step as one Triton program (`CacheTables.resolve`'s
decisions, bit for bit, with the copy list and pool rows `OffloadedExperts` needs).

As torch ops the resolution is ~130 small kernels a layer, each costing its slot in a recorded step. Here one
program a layer does it, the expert dimension (E ≤ 2^16) in registers. Gathers that depend on values (an
expert's rate by its slot's owner, a newcomer's row) read the tables back after a barrier, so the program
sees its own writes.

The newcomers (the misses, most frequent first) and their victims are chosen by rounds of argmax / argmin
(ties to the lower position, as the torch path's stable sort and unique keys order them), one round per
miss: the copy list has P = min(T·k, E) entries, the misses first; the entries past them are not valid
(expert 0 to the spare row: never copied), where the torch path lists the other experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.kernels.config import KERNELS, KernelConfig
from common.kernels.pdl import gdc_enter, launch

_KEY_MIN, _KEY_MAX = torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max
POLICY_CODES = {"lru": 0, "lfu": 1, "lfu-admit": 2}


@triton.jit
def _rate(freq_ptr, absent_ptr, at, mask):
    """freq / max(absent, 1) at `at` (the fresh-request rate, as `CacheTables._rate`), IEEE division."""
    f = tl.load(freq_ptr + at, mask=mask, other=0.0)
    a = tl.load(absent_ptr + at, mask=mask, other=1.0)
    return tl.math.div_rn(f, tl.maximum(a, 1.0))


@triton.jit
def _add(ptr, value):
    tl.store(ptr, tl.load(ptr) + value)


@triton.jit
def _pick(vec, pos, count, PB: tl.constexpr, P: tl.constexpr, LARGEST: tl.constexpr, SENTINEL):
    """`count` (≤ P) rounds of argmin (or argmax): ([PB] positions, keys) in order, ties to the lower
    position; entries from `count` on keep position 0 and key SENTINEL. Rounds past `count` are skipped:
    a step has as many rounds as misses (~2 of top-10 at a 0.8 hit rate), not P. A round is one reduction
    (the key and its position together): the rounds set the program's time, and a caller gathers what else
    it needs at the chosen positions from memory."""
    jj = tl.arange(0, PB)
    chosen = tl.zeros((PB,), dtype=tl.int64)
    keys = tl.zeros((PB,), dtype=tl.int64) + SENTINEL
    taken = pos < 0  # all False
    for j in range(P):
        if j < count:
            live = tl.where(taken, SENTINEL, vec)
            if LARGEST:
                key, at = tl.max(live, axis=0, return_indices=True, return_indices_tie_break_left=True)
            else:
                key, at = tl.min(live, axis=0, return_indices=True, return_indices_tie_break_left=True)
            chosen = tl.where(jj == j, at.to(tl.int64), chosen)
            keys = tl.where(jj == j, key, keys)
            taken = taken | (pos == at)
    return chosen, keys


@triton.jit
def _requests(ids_ptr, n_ids, e, live_e, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    """[BLOCK_E] bool: the experts among the n_ids ids."""
    req = e < 0  # all False
    for c in range(0, BLOCK_N, CHUNK):
        ids = tl.load(ids_ptr + c + tl.arange(0, CHUNK), mask=c + tl.arange(0, CHUNK) < n_ids, other=-1)
        req = req | (tl.max((e[:, None] == ids[None, :]).to(tl.int32), axis=1) > 0)
    return req & live_e


@triton.jit
def _pair_and_apply(
    miss, rate, reuse, asked_ptr, asked_rows, asked_stride, slot_of_ptr, owner_ptr, last_use_ptr, pinned_ptr,
    slot_table_ptr, freq_ptr, absent_ptr, counters_ptr, allowed, fetched_ptr, step,
    e, live_e, layer, num_layers, base, E, spare, KEY_MIN, KEY_MAX,
    POLICY: tl.constexpr, P: tl.constexpr, PB: tl.constexpr, FETCHED: tl.constexpr,
):  # fmt: skip
    """CacheTables._pair_misses then _apply: the misses (most frequent first) paired with victims, the layer's
    evictable slots whose expert is in none of asked_ptr's `asked_rows` rows (`asked_stride` apart: the
    requests of the pass's groups at the layer, this one's included), applied; `fetched` set to
    FETCHED on the filled slots; nothing is filled unless `allowed` (int32: the cache thawed, and for a guess
    the layer guessing) → (newcomer, victims, valid, is_miss) [PB]."""
    misses = tl.minimum(tl.sum(miss.to(tl.int32), axis=0), P)  # newcomers, and the victims they need

    # Victims: the row's evictable slots, lowest key first.
    slots = tl.load(slot_table_ptr + base + e, mask=live_e, other=spare)
    owner = tl.load(owner_ptr + slots)
    held = owner >= 0
    in_use = slots < 0  # all False
    for r in range(asked_rows):
        in_use = in_use | (held & (tl.load(asked_ptr + r * asked_stride + owner, mask=held, other=0) != 0))
    pinned = tl.load(pinned_ptr + slots) != 0
    evictable = ~pinned & ~in_use & (slots < spare) & live_e
    recency = tl.load(last_use_ptr + slots)
    if POLICY == 0:
        key = recency
    else:
        owner_rate = _rate(freq_ptr, absent_ptr, base + owner, held)
        key = (owner_rate.to(tl.int32, bitcast=True).to(tl.int64) << 32) + recency
    key = tl.where(held, key, KEY_MIN)
    key = tl.where(evictable, key, KEY_MAX)
    jj = tl.arange(0, PB)
    picked = jj < misses
    victim_at, victim_key = _pick(key, e, misses, PB, P, False, KEY_MAX)
    at_slot = tl.load(slot_table_ptr + base + victim_at, mask=picked & (victim_at < E), other=spare)
    victims = tl.where(picked, at_slot, 0)  # [PB] the slots at the chosen positions (0 past the count)

    # Newcomers: misses, most frequent first, ties to the lower expert id (the torch path's unique keys).
    miss_key = (rate.to(tl.int32, bitcast=True).to(tl.int64) << 16) + (E - 1 - e)
    miss_key = tl.where(miss, miss_key, -1)
    newcomer, newcomer_key = _pick(miss_key, e, misses, PB, P, True, -2)
    is_miss = newcomer_key >= 0
    thawed = (tl.zeros((PB,), dtype=tl.int32) + allowed) != 0  # a vector: masks mixing scalars in stay
    valid = is_miss & (victim_key < KEY_MAX) & thawed & (jj < P)  # boolean everywhere
    old = tl.load(owner_ptr + victims, mask=jj < P, other=-1)
    if POLICY == 2:  # lfu-admit (CacheTables._admit)
        newcomer_rate = _rate(freq_ptr, absent_ptr, base + newcomer, picked)  # `rate` at them, as stored
        new = reuse + (1.0 - reuse) * newcomer_rate
        old_rate = tl.where(old >= 0, _rate(freq_ptr, absent_ptr, base + old, old >= 0), float("-inf"))
        valid = valid & (new >= old_rate)

    # Apply (CacheTables._apply).
    evicted = valid & (old >= 0)
    _add(counters_ptr + 2 * num_layers + layer, tl.sum(evicted.to(tl.int64), axis=0))
    tl.store(slot_of_ptr + layer * (E + 1) + old, -1, mask=evicted)
    tl.debug_barrier()
    tl.store(owner_ptr + victims, newcomer, mask=valid)
    tl.store(slot_of_ptr + layer * (E + 1) + newcomer, victims, mask=valid)
    tl.store(last_use_ptr + victims, step, mask=valid)
    tl.store(fetched_ptr + victims, valid == FETCHED, mask=valid)
    tl.debug_barrier()
    return newcomer, victims, valid, is_miss


@triton.jit
def _resolve_kernel(
    ids_ptr, n_ids, slot_of_ptr, owner_ptr, last_use_ptr, pinned_ptr, slot_table_ptr,
    freq_ptr, absent_ptr, previous_ptr, reuse_ptr, counters_ptr, moved_ptr, thawed_ptr, step_ptr, fetched_ptr,
    predicted_ptr, row_ptr, newcomer_ptr, target_ptr, valid_ptr,
    layer, num_layers, decay_ptr, E, spare, staging_base, group, groups, KEY_MIN, KEY_MAX,
    POLICY: tl.constexpr, P: tl.constexpr, PB: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(GDC)
    e = tl.arange(0, BLOCK_E)
    live_e = e < E
    base = layer * E  # row of freq / absent / slot_table
    previous_at = previous_ptr + group * num_layers * E + base  # the group's previous step
    step = tl.load(step_ptr)
    decay = tl.load(decay_ptr)  # fp32, as torch multiplies an fp32 tensor by a Python float

    # Requests, then the statistics (CacheTables._count).
    req = _requests(ids_ptr, n_ids, e, live_e, BLOCK_N, CHUNK)
    prev = (tl.load(previous_at + e, mask=live_e, other=0) != 0) & live_e
    freq = tl.load(freq_ptr + base + e, mask=live_e, other=0.0) * decay + (req & ~prev).to(tl.float32)
    absent = tl.load(absent_ptr + base + e, mask=live_e, other=0.0) * decay + (~prev & live_e).to(tl.float32)
    tl.store(freq_ptr + base + e, freq, mask=live_e)
    tl.store(absent_ptr + base + e, absent, mask=live_e)
    tl.store(previous_at + e, req, mask=live_e)
    again = tl.sum((req & prev).to(tl.float32), axis=0)
    seen = tl.sum(prev.to(tl.float32), axis=0)
    reuse_hits = tl.load(reuse_ptr + 2 * layer) * decay + again
    reuse_seen = tl.load(reuse_ptr + 2 * layer + 1) * decay + seen
    tl.store(reuse_ptr + 2 * layer, reuse_hits)
    tl.store(reuse_ptr + 2 * layer + 1, reuse_seen)
    rate = tl.math.div_rn(freq, tl.maximum(absent, 1.0))  # [E]
    guessed = req & (tl.load(predicted_ptr + base + e, mask=live_e, other=0) != 0)  # a lookahead's, right
    _add(counters_ptr + 7 * num_layers + layer, tl.sum(guessed.to(tl.int64), axis=0))
    tl.store(predicted_ptr + base + e, req & ~req, mask=live_e)

    # Hits and misses; hits are stamped, and counted as prefetch hits on slots a prefetch filled.
    current = tl.load(slot_of_ptr + layer * (E + 1) + e, mask=live_e, other=-1)
    hit = req & (current >= 0)
    miss = req & (current < 0)
    tl.store(last_use_ptr + current, step, mask=hit)
    fetched = hit & (tl.load(fetched_ptr + current, mask=hit, other=0) != 0)
    _add(counters_ptr + 5 * num_layers + layer, tl.sum(fetched.to(tl.int64), axis=0))
    tl.store(fetched_ptr + current, hit & ~hit, mask=hit)
    tl.debug_barrier()
    reuse = tl.math.div_rn(reuse_hits, tl.maximum(reuse_seen, 1.0))
    newcomer, _, _, is_miss = _pair_and_apply(
        miss, rate, reuse, previous_ptr + base, groups, num_layers * E, slot_of_ptr, owner_ptr, last_use_ptr,
        pinned_ptr, slot_table_ptr, freq_ptr, absent_ptr, counters_ptr, tl.load(thawed_ptr).to(tl.int32),
        fetched_ptr, step, e, live_e, layer, num_layers, base, E, spare, KEY_MIN, KEY_MAX,
        POLICY, P, PB, False,
    )  # fmt: skip

    # Rows and counters.
    slot = tl.load(slot_of_ptr + layer * (E + 1) + e, mask=live_e, other=-1)
    filled = miss & (slot >= 0)
    bypass = miss & ~filled
    staging = staging_base + group * (E // groups) + tl.cumsum(bypass.to(tl.int64), axis=0) - 1
    row = tl.where(bypass, staging, tl.where(req & (slot >= 0), slot, spare))
    tl.store(row_ptr + e, row, mask=live_e)
    _add(counters_ptr + layer, tl.sum(hit.to(tl.int64), axis=0))
    _add(counters_ptr + num_layers + layer, tl.sum(miss.to(tl.int64), axis=0))
    _add(counters_ptr + 3 * num_layers + layer, tl.sum(bypass.to(tl.int64), axis=0))
    _add(moved_ptr + layer, tl.sum(filled.to(tl.int64), axis=0))
    _add(moved_ptr + num_layers + layer, tl.sum(bypass.to(tl.int64), axis=0))
    tl.debug_barrier()

    # The copy list: each miss to its row.
    jj = tl.arange(0, PB)
    target = tl.where(is_miss, tl.load(row_ptr + newcomer, mask=is_miss, other=spare), spare)
    tl.store(newcomer_ptr + jj, newcomer, mask=jj < P)
    tl.store(target_ptr + jj, target, mask=jj < P)
    tl.store(valid_ptr + jj, is_miss, mask=jj < P)


@triton.jit
def _prefetch_kernel(
    ids_ptr, n_ids, slot_of_ptr, owner_ptr, last_use_ptr, pinned_ptr, slot_table_ptr,
    freq_ptr, absent_ptr, predicted_ptr, reuse_ptr, counters_ptr, thawed_ptr, step_ptr,
    fetched_ptr, guessing_ptr, newcomer_ptr, target_ptr, valid_ptr, layer, num_layers, E, spare,
    KEY_MIN, KEY_MAX,
    POLICY: tl.constexpr, P: tl.constexpr, PB: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(GDC)
    e = tl.arange(0, BLOCK_E)
    live_e = e < E
    base = layer * E
    req = _requests(ids_ptr, n_ids, e, live_e, BLOCK_N, CHUNK)
    tl.store(predicted_ptr + base + e, req, mask=live_e)
    _add(counters_ptr + 6 * num_layers + layer, tl.sum(req.to(tl.int64), axis=0))
    allowed = tl.load(thawed_ptr).to(tl.int32) & tl.load(guessing_ptr + layer).to(tl.int32)
    rate = _rate(freq_ptr, absent_ptr, base + e, live_e)
    current = tl.load(slot_of_ptr + layer * (E + 1) + e, mask=live_e, other=-1)
    tl.debug_barrier()
    reuse_seen = tl.maximum(tl.load(reuse_ptr + 2 * layer + 1), 1.0)
    reuse = tl.math.div_rn(tl.load(reuse_ptr + 2 * layer), reuse_seen)
    newcomer, victims, valid, _ = _pair_and_apply(
        req & (current < 0), rate, reuse, predicted_ptr + base, 1, 0, slot_of_ptr, owner_ptr, last_use_ptr,
        pinned_ptr, slot_table_ptr, freq_ptr, absent_ptr, counters_ptr, allowed, fetched_ptr,
        tl.load(step_ptr), e, live_e, layer, num_layers, base, E, spare, KEY_MIN, KEY_MAX,
        POLICY, P, PB, True,
    )  # fmt: skip
    _add(counters_ptr + 4 * num_layers + layer, tl.sum(valid.to(tl.int64), axis=0))
    jj = tl.arange(0, PB)
    tl.store(newcomer_ptr + jj, newcomer, mask=jj < P)
    tl.store(target_ptr + jj, tl.where(valid, victims, spare), mask=jj < P)
    tl.store(valid_ptr + jj, valid, mask=jj < P)


NUM_WARPS = 4
"""Warps of the one program (`python -m bench.resolve_warps`): the serial rounds of argmin/argmax over E set
the time more than the warps do."""


def _copy_list(p: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An empty copy list: newcomer, target [P] int64, valid [P] bool."""
    ids = lambda: torch.empty(p, dtype=torch.int64, device=device)
    return ids(), ids(), torch.empty(p, dtype=torch.bool, device=device)


def _launch_shape(tables, p: int, n: int) -> dict:
    """The programs' compile-time shape and launch options for P pairs and n ids."""
    e = tables.num_experts
    shape = {"POLICY": POLICY_CODES[tables.policy], "P": p, "PB": triton.next_power_of_2(p)}
    shape |= {
        "BLOCK_E": triton.next_power_of_2(e),
        "BLOCK_N": max(16, triton.next_power_of_2(n)),
        "CHUNK": 16,
    }
    return shape | {"enable_fp_fusion": False}  # torch rounds each multiply and add: an fma would not


def resolve_step(
    tables,
    layer: int,
    ids: torch.Tensor,
    step: torch.Tensor,
    moved: torch.Tensor,
    num_warps: int = 0,
    group: int = 0,
    groups: int = 1,
    kernels: KernelConfig = KERNELS,
):
    """`tables.resolve` for the experts `ids` ([T, k] or flat) of `layer` (decode group `group` of `groups`),
    as one program → (row [E], newcomer [P], target [P], valid [P]) with P = min(ids.numel(), E); moved
    [≥ 2, L] int64 gets the fills (row 0) and bypasses (row 1). `step` is a 0-d int64 device tensor. Tables
    on a CUDA device (or the interpreter)."""
    e, n = tables.num_experts, ids.numel()
    p = min(n, e)
    row = torch.empty(e, dtype=torch.int64, device=tables.slot_of.device)
    newcomer, target, valid = _copy_list(p, tables.slot_of.device)
    _resolve_kernel[(1,)](
        ids.reshape(-1), n, tables.slot_of, tables.owner, tables.last_use, tables.pinned, tables.slot_table,
        tables.freq, tables.absent, tables.previous, tables.reuse, tables.counts, moved, tables.thawed, step,
        tables.fetched, tables.predicted, row, newcomer, target, valid, layer, tables.num_layers,
        tables.decay_on_device, e, tables.num_slots, tables.staging_base, group, groups, _KEY_MIN, _KEY_MAX,
        **_launch_shape(tables, p, n), num_warps=num_warps or NUM_WARPS,
        **launch(ids.device, kernels=kernels),
    )  # fmt: skip
    return row, newcomer, target, valid


def prefetch_step(
    tables, layer: int, ids: torch.Tensor, step: torch.Tensor, max_new: int, kernels: KernelConfig = KERNELS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`tables.prefetch` for the predicted experts `ids` ([T, n] or flat) of `layer`, as one program → the
    copy list (newcomer, target, valid) [P], P = min(max_new, E)."""
    e, n = tables.num_experts, ids.numel()
    p = min(max_new, e)
    newcomer, target, valid = _copy_list(p, tables.slot_of.device)
    _prefetch_kernel[(1,)](
        ids.reshape(-1), n, tables.slot_of, tables.owner, tables.last_use, tables.pinned, tables.slot_table,
        tables.freq, tables.absent, tables.predicted, tables.reuse, tables.counts, tables.thawed, step,
        tables.fetched, tables.guessing, newcomer, target, valid, layer, tables.num_layers, e,
        tables.num_slots, _KEY_MIN, _KEY_MAX, **_launch_shape(tables, p, n), num_warps=NUM_WARPS,
        **launch(ids.device, kernels=kernels),
    )  # fmt: skip
    return newcomer, target, valid
