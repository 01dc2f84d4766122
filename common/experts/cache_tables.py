"""The VRAM expert cache's bookkeeping: which expert sits in which slot, and whom to evict — as device ops.

`CacheTables.resolve` serves one layer's step with fixed-shape tensor ops and no host synchronisation (fills
and index_fill_, never `t[i] = scalar`), so that it runs inside a captured decode step: requested experts
are hits or misses; misses, most frequent first, take the lowest-scoring evictable slots of their layer
(free slots first; never a slot a hit of the same step uses). After it, every requested expert has a pool
row: its slot (rows [0, S)), or for a bypass (a miss that got no slot) a staging row (the j-th bypass in
expert order at S+1+j), the spare row S standing for the others; the pool has `num_rows` = S+1+E rows. The
step's copy list has a fixed shape [P] (P = min(max_new, E)): no `nonzero`, no host round trip.

Its parts, one class each, stacked: `slot_tables`, `request_stats`, `eviction`, `capacity`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from common.experts.capacity import SlotCapacity
from common.experts.eviction import DEFAULT_POLICY, POLICIES
from common.experts.request_stats import DECODE_GROUPS

__all__ = ["DECODE_GROUPS", "DEFAULT_POLICY", "POLICIES", "CacheTables", "Resolution"]


@dataclass
class Resolution:
    """What one layer's step got from the cache: per expert of the layer ([E] each), then the copy list ([P]).

    The copy list pairs every miss with its destination row: `pool[target[p]] ← host[newcomer[p]]` for each p
    with `valid[p]`; the other entries are padding (target = the spare row) that a copy skips.
    """

    slot: torch.Tensor
    """Slot holding the expert after the step (hits and admitted misses); −1 otherwise."""
    filled: torch.Tensor
    """Missed experts copied into `slot` this step (they must be loaded before use)."""
    bypass: torch.Tensor
    """Requested experts computed from host memory (misses that got no slot): copied to a staging row."""
    row: torch.Tensor
    """[E] pool row of each expert for this step: its slot (hits, admitted misses), a staging row (bypasses),
    the spare row (not requested)."""
    newcomer: torch.Tensor
    """[P] expert ids: the misses (most frequent first), then padding."""
    target: torch.Tensor
    """[P] destination rows: the victim slot of an admitted miss, the staging row of a bypass, else spare."""
    valid: torch.Tensor
    """[P] bool: whether the pair is a miss to copy."""


class CacheTables(SlotCapacity):
    """Slot ownership, recency, frequency and pinning of an expert cache over layers × experts, and the
    per-step operations on them: `resolve` (a step's requests) and `prefetch` (a lookahead's guess)."""

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        slots_per_layer: Sequence[int],
        policy: str = DEFAULT_POLICY,
        device: torch.device | str = "cpu",
        decay: float = 0.9995,
        pinned: Mapping[int, Sequence[int]] | None = None,
        lendable: int = 0,
    ) -> None:
        """`lendable` slots beyond the layers' capacities are the bank (`lend`, `reclaim`): memory that
        another user (the prefill arena, the KV pool's idle pages) holds at times, given to the layers while
        it is idle. `decay`: the statistics' decay per step of their layer (a half-life of ln 2 / (1 − decay)
        steps). `pinned`: layer → experts given slots that are never evicted."""
        super().__init__(num_layers, num_experts, slots_per_layer, lendable, device, decay, policy)
        self.predicted = torch.zeros(num_layers, num_experts, dtype=torch.bool, device=device)
        """The experts each layer's `prefetch` was given, until the layer's next `resolve` compares them with
        its requests (counters `guesses`, `guesses_used`) and clears them."""
        self.guessing = torch.ones(num_layers, dtype=torch.bool, device=device)
        """Per layer, whether `prefetch` copies its guesses in (else it only records them, so that their
        precision is still measured): set between steps (`OffloadedExperts` gates it on that precision)."""
        for layer, experts in (pinned or {}).items():
            self.pin(layer, experts)

    def resolve(
        self,
        layer: int,
        requested: torch.Tensor,
        step: int | torch.Tensor,
        max_new: int,
        group: int = 0,
        groups: int = 1,
    ) -> Resolution:
        """Serve a step of `layer` that uses the experts in `requested` ([E] bool).

        `step` (an int, or a 0-d device tensor that a recorded step reads at replay) stamps recency.
        `max_new` bounds the misses that can take a slot this step (the tokens' expert choices, known on the
        host): it fixes the shape of the pairing and of the copy list, not the result. The copy list covers
        every miss when `max_new` is at least the number of requested experts.
        A pass split into `groups` groups of lanes resolves each layer once per group, in group order, each
        group a step of its own in the statistics. A group never evicts what any group last requested at
        the layer (the groups before it compute from those slots while this one's copies run). Its bypasses
        take their own share of the staging rows (E // groups each).
        """
        e, spare = self.num_experts, self.num_slots
        self._count(layer, requested, group)
        self.counters["guesses_used"][layer].add_((requested & self.predicted[layer]).sum())
        self.predicted[layer].zero_()
        rate = self._rate(layer)
        current = self.slot_of[layer, :e]  # [E]
        hit = requested & (current >= 0)
        miss = requested & (current < 0)
        hit_slot = torch.where(hit, current, spare)
        self._stamp(hit_slot, step)
        self.counters["prefetch_hits"][layer].add_(self.fetched[hit_slot].sum())  # fetched[spare]: False
        self.fetched.index_fill_(0, hit_slot, False)
        in_use = hit_slot  # this step's requests that hold a slot
        if groups > 1:  # and every other group's last ones
            asked = self.previous[:groups, layer].any(0)  # [E] (this group's row: `requested`)
            in_use = torch.where(asked & (current >= 0), current, spare)
        newcomer, victims, valid = self._pair_misses(layer, miss, in_use, rate, min(max_new, e))
        self._apply(layer, newcomer, victims, valid, step)

        slot = torch.where(requested, self.slot_of[layer, :e], -1)
        filled = torch.zeros(e + 1, dtype=torch.bool, device=self.device)
        filled.index_fill_(0, torch.where(valid, newcomer, e), True)
        filled = filled[:e]
        bypass = miss & ~filled
        self.counters["hits"][layer].add_(hit.sum())
        self.counters["misses"][layer].add_(miss.sum())
        self.counters["bypasses"][layer].add_(bypass.sum())
        row = self._rows(slot, bypass, group * (e // groups))
        need = miss[newcomer]  # the copy list: every miss (there are at most max_new), then padding
        target = torch.where(need, row[newcomer], spare)
        return Resolution(
            slot=slot, filled=filled, bypass=bypass, row=row, newcomer=newcomer, target=target, valid=need
        )

    def prefetch(
        self, layer: int, predicted: torch.Tensor, step: int | torch.Tensor, max_new: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Lookahead: give the experts a layer is predicted to request (`predicted` [E] bool) slots before
        its step, as that step's misses would take them (the same victims and admission), without counting
        requests or touching the recency of those already cached (a guess is not a use). Predicted experts
        that are cached are not evicted for the others. At most `max_new` fills (the byte budget; fixes the
        shapes) → the copy list newcomer, target, valid [P]: `pool[target[p]] ← host[newcomer[p]]` where
        valid. A later `resolve` that hits a slot filled here counts a prefetch hit. While the layer is not
        `guessing`, the guess is only recorded (nothing is filled)."""
        e, spare = self.num_experts, self.num_slots
        self.predicted[layer].copy_(predicted)
        self.counters["guesses"][layer].add_(predicted.sum())
        rate = self._rate(layer)
        current = self.slot_of[layer, :e]  # [E]
        held = torch.where(predicted & (current >= 0), current, spare)
        absent = predicted & (current < 0)
        newcomer, victims, valid = self._pair_misses(layer, absent, held, rate, min(max_new, e))
        valid &= self.guessing[layer]
        self._apply(layer, newcomer, victims, valid, step)
        target = torch.where(valid, victims, spare)
        self.fetched.index_fill_(0, target, True)
        self.fetched[spare].fill_(False)
        self.counters["prefetches"][layer].add_(valid.sum())
        return newcomer, target, valid

    def check(self) -> None:
        """Invariants (tests): no slot owned twice, tables agree, capacities sum to the slot count (less the
        bank's while it is not lent, when its slots hold nothing)."""
        self._check_bank()
        self._check_layers()
