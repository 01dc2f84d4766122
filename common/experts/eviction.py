"""Whom the expert cache evicts and admits (`EvictionPolicy`, a base of `CacheTables`): the eviction order of
a layer's slots under each policy, the admission test, and the pairing of a step's misses with victims.

`lru` scores a slot by its last use. `lfu` scores it by its expert's fresh-request rate (`RequestStats`),
ties to the least recently used. `lfu-admit` is `lfu` with an admission test in the spirit of TinyLFU: a
miss is inserted only if its chance of use by the next step — the layer's measured reuse probability, else
its fresh-request rate — is at least its victim's fresh-request rate; otherwise it is a bypass.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.experts.request_stats import RequestStats

POLICIES = ("lru", "lfu", "lfu-admit")
DEFAULT_POLICY = "lfu-admit"
KEY_MIN, KEY_MAX = torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max  # free / unevictable slots
COUNTERS = (
    "hits",
    "misses",
    "evictions",
    "bypasses",
    "prefetches",
    "prefetch_hits",
    "guesses",
    "guesses_used",
)
"""The per-layer event counters (`counters`)."""


class EvictionPolicy(RequestStats):
    """Eviction order, admission and insertion under `policy`, with the cache's event counters and its
    freeze (`frozen`: nothing inserted or evicted)."""

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        slots_per_layer: Sequence[int],
        lendable: int,
        device: torch.device | str,
        decay: float,
        policy: str,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"cache policy {policy!r} is not one of {POLICIES}")
        super().__init__(num_layers, num_experts, slots_per_layer, lendable, device, decay)
        self.policy, s = policy, self.num_slots
        self.fetched = torch.zeros(s + 1, dtype=torch.bool, device=device)
        """Slots `prefetch` filled that no step has used since (a hit on one counts as a prefetch hit)."""
        self.counts = torch.zeros(len(COUNTERS), num_layers, dtype=torch.int64, device=device)
        self.counters = {n: self.counts[i] for i, n in enumerate(COUNTERS)}  # views, [L] each
        self.thawed = torch.ones((), dtype=torch.bool, device=device)
        """The device copy of `not frozen` that recorded steps read."""
        self._expert_ids = torch.arange(num_experts, device=device)
        if num_experts > 1 << 16:
            raise ValueError(f"{num_experts} experts per layer: the miss order keys hold at most 65536")
        self.frozen = False

    @property
    def frozen(self) -> bool:
        """While True (a prefill reads the slots in place), nothing is inserted or evicted: every miss is a
        bypass, and rebalance waits. Set between steps (a device flag, so recorded steps follow it)."""
        return self._frozen

    @frozen.setter
    def frozen(self, value: bool) -> None:
        self._frozen = value
        self.thawed.fill_(not value)

    def _admit(
        self, layer: int, rate: torch.Tensor, newcomer: torch.Tensor, old: torch.Tensor
    ) -> torch.Tensor:
        """lfu-admit: is each newcomer's chance of use by the next step at least its victim's?"""
        reuse = self.reuse[layer, 0] / self.reuse[layer, 1].clamp(min=1.0)
        new = reuse + (1.0 - reuse) * rate[newcomer]  # requested now: kept, or else requested afresh
        old_rate = torch.where(old >= 0, rate[old.clamp(min=0)], float("-inf"))  # a free slot admits
        return new >= old_rate

    def _evict_key(self, owner: torch.Tensor, slots: torch.Tensor, rate: torch.Tensor) -> torch.Tensor:
        """int64 eviction order of `slots` (lowest first): last use (lru), or rate then last use (lfu*).

        For LFU the key is an exact lexicographic order: a non-negative float32's bit pattern read as an int
        orders like the float, so (rate bits << 32) + last use sorts by rate, ties by recency (a float score
        with a tiny recency term would lose the tie-break to rounding). Steps must stay below 2^32.
        """
        recency = self.last_use[slots]
        if self.policy == "lru":
            return recency
        bits = rate[owner.clamp(min=0)].view(torch.int32).to(torch.int64)
        return (bits << 32) + recency

    def _give_order(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(owners, keys) of `layer`'s `slots`: the order in which the layer gives slots up, lowest key
        first (free slots first, pinned ones never)."""
        owner = self.owner[slots]
        key = torch.where(owner < 0, KEY_MIN, self._evict_key(owner, slots, self._rate(layer)))
        return owner, torch.where(self.pinned[slots], KEY_MAX, key)

    def _pair_misses(
        self, layer: int, miss: torch.Tensor, in_use: torch.Tensor, rate: torch.Tensor, pairs: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The misses ([E] bool), most frequent first, each paired with a victim: the layer's evictable
        slots (not pinned, not in `in_use` [N] slots), lowest key first (free slots first) → newcomer,
        victims, valid [P] (valid: a miss with a victim the policy lets it take)."""
        e, spare = self.num_experts, self.num_slots
        slots = self.slot_table[layer]  # [E]: the layer's C slots, then the spare as padding
        owner = self.owner[slots]
        used = torch.zeros(spare + 1, dtype=torch.bool, device=self.device)
        used.index_fill_(0, in_use, True)
        evictable = ~self.pinned[slots] & ~used[slots] & (slots < spare)  # the row's padding: never
        key = torch.where(owner < 0, KEY_MIN, self._evict_key(owner, slots, rate))
        key = torch.where(evictable, key, KEY_MAX)
        victim_key, victim_idx = torch.sort(key, stable=True)  # ties: the row's first slot first
        victim_key, victim_idx = victim_key[:pairs], victim_idx[:pairs]  # [P]
        victims = slots[victim_idx]
        # Misses, most frequent first (ties: lower expert id): one int64 key per expert, unique, so a top-P
        # gives the order a stable sort would (and costs less than sorting all E).
        miss_key = (rate.view(torch.int32).to(torch.int64) << 16) + (e - 1 - self._expert_ids)  # rate ≥ 0
        newcomer = torch.topk(torch.where(miss, miss_key, -1), pairs).indices  # [P] misses first
        valid = miss[newcomer] & (victim_key < KEY_MAX) & self.thawed
        if self.policy == "lfu-admit":
            valid &= self._admit(layer, rate, newcomer, self.owner[victims])
        return newcomer, victims, valid

    def _apply(
        self,
        layer: int,
        newcomer: torch.Tensor,
        victims: torch.Tensor,
        valid: torch.Tensor,
        step: int | torch.Tensor,
    ) -> None:
        """Insert each valid newcomer into its victim slot, evicting the victim's expert (fixed shapes)."""
        e, spare = self.num_experts, self.num_slots
        old = self.owner[victims]
        evicted = valid & (old >= 0)
        slot_of = self.slot_of[layer]  # [E + 1] (a view)
        self.counters["evictions"][layer].add_(evicted.sum())
        slot_of.index_fill_(0, torch.where(evicted, old, e), -1)
        target = torch.where(valid, victims, spare)
        self.owner.index_copy_(0, target, torch.where(valid, newcomer, -1))
        self.fetched.index_fill_(0, target, False)
        slot_of.index_copy_(0, torch.where(valid, newcomer, e), torch.where(valid, victims, -1))
        self._stamp(target, step)
        self.owner[spare].fill_(-1)
        slot_of[e].fill_(-1)
