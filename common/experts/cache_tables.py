"""The VRAM expert cache's bookkeeping: which expert sits in which slot, and whom to evict — as device ops.

S slots, partitioned by layer (a slot serves one layer until capacity is rebalanced). Tables on the device:
`slot_of[layer, expert]` (−1: absent), `owner[slot]` (expert or −1), `last_use[slot]`, `pinned[slot]` (a
calibration hot set that is never evicted) and, for every expert, cached or not, its request statistics
(`freq`, `absent`; per layer, `reuse`). `resolve` serves one layer's step with fixed-shape tensor ops — no
host synchronisation (no `t[i] = scalar`, which copies the scalar to the device and synchronises: fills
and index_fill_ instead) — so that it can run inside a captured decode step: requested experts are hits or
misses; misses, most frequent first, take the lowest-scoring evictable slots of their layer (free slots first;
never a slot a hit of the same step uses). Every table has one spare entry at its end that absorbs the writes
of invalid pairs.

Device rows. After `resolve`, every requested expert has a row of the cache's pool (the device tensors that
hold expert weights, one expert a row): rows [0, S) are the slots, row S is a spare row whose contents do not
matter (it absorbs invalid copies and stands for unrequested experts), and rows [S+1, S+1+E) are staging rows
for bypasses (misses that got no slot: their weights are copied there for this step only, the j-th bypass in
expert order to row S+1+j). So the pool has `num_rows` = S+1+E rows. `resolve` also returns the step's copy
list with a fixed shape [P] (P = min(max_new, E)): a copy launch needs no `nonzero` and no host round trip,
and a kernel skips the invalid entries.

Policies. `lru` scores a slot by its last use. `lfu` scores it by its expert's fresh-request rate, ties to
the least recently used. A request is fresh unless the expert was also requested by the layer's previous step:
a run of consecutive requests is one correlated reference (as in LRU-K), and `freq / absent` (decayed counts
of fresh requests and of the steps that could have made one) estimates P(requested | not requested by the
previous step) — what decides the next use of an eviction candidate, which the current step did not request.
(A plain request count is inflated by bursts; a plain fresh count undercounts an expert requested at nearly
every step.) The statistics decay by `decay` per step of their layer (0.9995: a half-life of ~1,400 steps,
long enough for stable estimates, short enough to follow a drifting workload). A prefill pass counts its
tokens as steps too (`observe`: added, undecayed), so decode starts from the prompt's rates rather than from
nothing.

`lfu-admit` is `lfu` with an admission test in the spirit of TinyLFU: a miss is inserted only if its chance
of use by the next step — the layer's measured reuse probability (the share of a step's experts that the next
step requests again), else its fresh-request rate — is at least its victim's fresh-request rate; otherwise it
is a bypass (computed from host memory). With strong step-to-step reuse it admits almost every miss (a brief
stay is likely to pay, and a newcomer that is not reused is the next victim); without reuse it is TinyLFU's
"admit only if the newcomer is requested more often than the victim".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

POLICIES = ("lru", "lfu", "lfu-admit")
DEFAULT_POLICY = "lfu-admit"
_KEY_MIN, _KEY_MAX = torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max  # free / unevictable slots
DECODE_GROUPS = 2
"""Most groups a decode pass's lanes are split into (`resolve`'s `group`; common/model/groups.py)."""


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


class CacheTables:
    """Slot ownership, recency, frequency and pinning of an expert cache over layers × experts."""

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
        it is idle."""
        if policy not in POLICIES:
            raise ValueError(f"cache policy {policy!r} is not one of {POLICIES}")
        if len(slots_per_layer) != num_layers:
            raise ValueError(f"{len(slots_per_layer)} layer capacities for {num_layers} layers")
        self.num_layers, self.num_experts, self.policy, self.decay = num_layers, num_experts, policy, decay
        self.num_slots = sum(slots_per_layer) + lendable
        self.device = torch.device(device)
        s, e = self.num_slots, num_experts
        self.slot_of = torch.full((num_layers, e + 1), -1, dtype=torch.int64, device=device)  # col e: spare
        self.owner = torch.full((s + 1,), -1, dtype=torch.int64, device=device)  # slot s: spare
        self.last_use = torch.zeros(s + 1, dtype=torch.int64, device=device)
        self.pinned = torch.zeros(s + 1, dtype=torch.bool, device=device)
        self.freq = torch.zeros(num_layers, e, dtype=torch.float32, device=device)
        # The previous step's requests, per decode group (`resolve`); per expert, the decayed count of steps
        # that could make a fresh request (the expert was not requested by the step before), so freq /
        # absent estimates P(requested | not requested by the previous step); per layer, decayed counts of
        # [experts requested again by the next step, experts requested] (the reuse probability).
        self.previous = torch.zeros(DECODE_GROUPS, num_layers, e, dtype=torch.bool, device=device)
        self.groups = 1
        """The groups of the decode passes served now (`regroup`)."""
        self.absent = torch.zeros(num_layers, e, dtype=torch.float32, device=device)
        self.reuse = torch.zeros(num_layers, 2, dtype=torch.float32, device=device)
        self.observed = torch.zeros(num_layers, e, dtype=torch.bool, device=device)
        """The last prompt token `observe` counted, per layer (a prompt's own previous step)."""
        self.predicted = torch.zeros(num_layers, e, dtype=torch.bool, device=device)
        """The experts each layer's `prefetch` was given, until the layer's next `resolve` compares them with
        its requests (counters `guesses`, `guesses_used`) and clears them."""
        self.guessing = torch.ones(num_layers, dtype=torch.bool, device=device)
        """Per layer, whether `prefetch` copies its guesses in (else it only records them, so that their
        precision is still measured): set between steps (`OffloadedExperts` gates it on that precision)."""
        self.fetched = torch.zeros(s + 1, dtype=torch.bool, device=device)
        """Slots `prefetch` filled that no step has used since (a hit on one counts as a prefetch hit)."""
        counters = ("hits", "misses", "evictions", "bypasses", "prefetches", "prefetch_hits", "guesses")
        counters += ("guesses_used",)
        self.counts = torch.zeros(len(counters), num_layers, dtype=torch.int64, device=device)
        self.counters = {n: self.counts[i] for i, n in enumerate(counters)}  # views, [L] each
        # Layer l's slots are slot_table[l, :capacity[l]], the rest of the row is the spare slot: a fixed
        # shape that rebalance rewrites in place, so a recorded step stays valid when capacities move.
        self.slot_table = torch.full((num_layers, e), s, dtype=torch.int64, device=device)
        self._capacities: list[int] = []
        self._assign(list(slots_per_layer))
        self.bank = torch.arange(self.num_slots - lendable, self.num_slots, device=device)
        """The lendable slots (the last ones): in no layer's list until `lend`, again after `reclaim`."""
        self.lent_mask = torch.zeros(s + 1, dtype=torch.bool, device=device)
        """The bank slots the layers hold now."""
        self.lent = 0
        """How many: a host count, so the whole-bank `lend` of each arena-lending pass returns unsynced."""
        self.readers = False
        """Another process reads the slots in place while the cache is frozen (a serving decode worker's
        prefill): lent slots cannot be reclaimed then. Without readers a freeze only keeps a pass from
        leaving a trace (`OffloadedExperts.untracked`), and reclaiming is safe."""
        self.decay_on_device = torch.tensor(decay, dtype=torch.float32, device=device)
        self.thawed = torch.ones((), dtype=torch.bool, device=device)
        """The device copy of `not frozen` that recorded steps read."""
        self._expert_ids = torch.arange(e, device=device)
        if e > 1 << 16:
            raise ValueError(f"{e} experts per layer: the miss order keys hold at most 65536")
        self.frozen = False
        for layer, experts in (pinned or {}).items():
            self.pin(layer, experts)

    @property
    def capacities(self) -> list[int]:
        return list(self._capacities)

    @property
    def layer_slots(self) -> list[torch.Tensor]:
        """Each layer's slots (views of `slot_table`)."""
        return [self.slot_table[layer, :c] for layer, c in enumerate(self._capacities)]

    @property
    def frozen(self) -> bool:
        """While True (a prefill reads the slots in place), nothing is inserted or evicted: every miss is a
        bypass, and rebalance waits. Set between steps (a device flag, so recorded steps follow it)."""
        return self._frozen

    @frozen.setter
    def frozen(self, value: bool) -> None:
        self._frozen = value
        self.thawed.fill_(not value)

    @property
    def staging_base(self) -> int:
        """First staging row of the pool (after the S slots and the spare row)."""
        return self.num_slots + 1

    @property
    def num_rows(self) -> int:
        """Rows of a pool served by these tables: S slots, the spare row, E staging rows."""
        return self.num_slots + 1 + self.num_experts

    def _assign(self, capacities: list[int]) -> None:
        if max(capacities, default=0) > self.num_experts:
            raise ValueError(
                f"a layer of {self.num_experts} experts needs at most as many slots: {capacities}"
            )
        start = 0
        for layer, c in enumerate(capacities):
            self.slot_table[layer, :c] = torch.arange(start, start + c, device=self.device)
            start += c
        self._capacities = list(capacities)

    def lend(self, slots: torch.Tensor | None = None) -> None:
        """Between steps: give bank slots (`slots`, default the whole bank; those lent already are skipped)
        to the layers, as even a share each as their room allows (capacity moves on from there with
        `rebalance`); they start free. Slots past every layer's room stay in the bank."""
        if slots is None and self.lent:  # the whole bank, lent already (as far as the layers had room)
            return
        give = self.bank if slots is None else slots.to(self.device)
        give = give[~self.lent_mask[give]]
        room = [self.num_experts - c for c in self._capacities]
        share, left = [0] * self.num_layers, min(give.numel(), sum(room))
        while left:  # round robin over the layers with room
            for layer in range(self.num_layers):
                if left and share[layer] < room[layer]:
                    share[layer], left = share[layer] + 1, left - 1
        start = 0
        for layer, n in enumerate(share):
            c = self._capacities[layer]
            self.slot_table[layer, c : c + n] = give[start : start + n]
            self._capacities[layer] = c + n
            start += n
        self.lent_mask[give[:start]] = True
        self.lent += start

    def reclaim(self, slots: torch.Tensor | None = None) -> None:
        """Between steps: take bank slots back (`slots`, default the whole bank) from whichever layers hold
        them now, evicting their experts, before their memory is used for something else. A layer left with
        no slot (rebalancing may have given its own away while it held lent ones) gets one back from the
        layer with the most. With `readers`, the evictions have landed on the device when it returns: another
        process may read the tables, or write the slots' memory, as soon as it is told."""
        if not self.lent:
            return
        take = self.bank if slots is None else slots.to(self.device)
        take = take[self.lent_mask[take]]
        if take.numel() == 0:
            return
        if self.frozen and self.readers:
            raise RuntimeError("reclaiming lent slots while the cache is frozen (a reader may be using them)")
        for layer, held_slots in enumerate(self.layer_slots):
            lent = torch.isin(held_slots, take)
            if not bool(lent.any()):
                continue
            held = self.owner[held_slots[lent]]
            self.slot_of[layer, held[held >= 0]] = -1
            kept = held_slots[~lent]
            self.slot_table[layer].fill_(self.num_slots)
            self.slot_table[layer, : kept.numel()] = kept
            self._capacities[layer] = kept.numel()
        self.owner[take] = -1
        self.last_use[take] = 0
        self.lent_mask[take] = False
        self.lent -= take.numel()
        for layer in range(self.num_layers):
            if self._capacities[layer] == 0:
                donor = max(range(self.num_layers), key=lambda d: self._capacities[d])
                donor_slots = self.layer_slots[donor]
                _, key = self._give_order(donor, donor_slots)
                if self._capacities[donor] > 1 and int(key.min()) < _KEY_MAX:
                    self._move(donor, layer, donor_slots[key.argmin()].reshape(1))
        if self.readers and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def pin(self, layer: int, experts: Sequence[int]) -> None:
        """Load-time: give `experts` of `layer` slots that are never evicted (they must still be filled)."""
        slots = self.layer_slots[layer][: len(experts)]
        if len(slots) < len(experts):
            raise ValueError(f"layer {layer}: {len(experts)} pinned experts, {len(slots)} slots")
        ids = torch.tensor(list(experts), dtype=torch.int64, device=self.device)
        self.owner[slots] = ids
        self.slot_of[layer, ids] = slots
        self.pinned[slots] = True

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

        A pass split into `groups` groups of lanes (common/model/groups.py) resolves each layer once per
        group, in group order, and each group is a step of its own in the statistics (its previous step is
        its own). A group never evicts what any group last requested at the layer: the groups before it in
        this pass compute from those slots while this one's copies run (the later ones' requests of the pass
        before are kept too). Its bypasses take their own share of the staging rows (E // groups each).
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

    def regroup(self, groups: int) -> None:
        """Between steps, before a decode pass of `groups` groups when the passes before had another count:
        every group's previous step becomes the last pass's requests, all its groups' together. Else a
        group's row would be that of a grouped pass long gone: its freshness and reuse measured against it,
        and its experts protected from eviction (`resolve`)."""
        if groups == self.groups:
            return
        if not 1 <= groups <= DECODE_GROUPS:
            raise ValueError(f"a decode pass runs in 1 to {DECODE_GROUPS} groups, not {groups}")
        merged = self.previous[: self.groups].any(0)  # [L, E]
        self.previous[:groups] = merged  # rows past `groups` are not read until the next regroup
        self.groups = groups

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
        key = torch.where(owner < 0, _KEY_MIN, self._evict_key(owner, slots, rate))
        key = torch.where(evictable, key, _KEY_MAX)
        victim_key, victim_idx = torch.sort(key, stable=True)  # ties: the row's first slot first
        victim_key, victim_idx = victim_key[:pairs], victim_idx[:pairs]  # [P]
        victims = slots[victim_idx]
        # Misses, most frequent first (ties: lower expert id): one int64 key per expert, unique, so a top-P
        # gives the order a stable sort would (and costs less than sorting all E).
        miss_key = (rate.view(torch.int32).to(torch.int64) << 16) + (e - 1 - self._expert_ids)  # rate ≥ 0
        newcomer = torch.topk(torch.where(miss, miss_key, -1), pairs).indices  # [P] misses first
        valid = miss[newcomer] & (victim_key < _KEY_MAX) & self.thawed
        if self.policy == "lfu-admit":
            valid &= self._admit(layer, rate, newcomer, self.owner[victims])
        return newcomer, victims, valid

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

    def _stamp(self, slots: torch.Tensor, step: int | torch.Tensor) -> None:
        """last_use[slots] = step (index_fill_ would read a tensor step on the host: a sync)."""
        if isinstance(step, torch.Tensor):
            self.last_use.index_copy_(0, slots, step.expand(slots.shape[0]))
        else:
            self.last_use.index_fill_(0, slots, step)

    def _rows(self, slot: torch.Tensor, bypass: torch.Tensor, first: int = 0) -> torch.Tensor:
        """[E] pool row of each expert: its slot, else the next staging row from staging row `first` on for a
        bypass, else the spare."""
        staging = self.staging_base + first + torch.cumsum(bypass, 0) - 1  # [E] j-th bypass → its row
        return torch.where(bypass, staging, torch.where(slot >= 0, slot, self.num_slots))

    def _count(self, layer: int, requested: torch.Tensor, group: int = 0) -> None:
        """Update the layer's request statistics with this step's requests (a step of decode group
        `group`)."""
        previous, d = self.previous[group, layer], self.decay
        fresh = requested & ~previous  # a run of consecutive requests counts once
        self.freq[layer].mul_(d).add_(fresh.float())
        self.absent[layer].mul_(d).add_((~previous).float())
        again = torch.stack([(requested & previous).sum(), previous.sum()]).float()
        self.reuse[layer].mul_(d).add_(again)
        previous.copy_(requested)

    def observe(self, layer: int, ids: torch.Tensor) -> None:
        """Prefill: add the tokens of a prompt pass — `ids` [T, k], the layer's expert choices in token order
        (distinct in a row, as top-k's are) — to the layer's request statistics as T steps, each counted once
        (no decay among them, so a prompt's passes add up to the same whatever its chunking; decode's steps
        then decay them as their own), without touching slots, recency or decode's previous step. The
        prompt's routing is the best estimate of its continuation's: decode starts with rates counted over
        the prompt instead of from nothing (`python -m bench.prompt_seeding`). A token's previous step is the
        token observed before it in the layer (`observed`: the previous pass's last, across prompts too).

        Counted from the ids, not from [T, E] masks: a token's repeats are its choices among the previous
        token's ([T, k, k] compares), an expert's requests a scatter-add; ~12 launches a pass, where masks
        took ~12 a slice of 1,024 tokens (prefill-25k: ~14,000 small kernels, ~50 ms of GPU)."""
        if ids.shape[0] == 0:
            return
        ids = ids.long()  # index_fill's indices
        (t, k), flat = ids.shape, ids.flatten()
        observed = self.observed[layer]
        repeat = torch.cat([observed[ids[:1]], (ids[1:, :, None] == ids[:-1, None, :]).any(-1)])  # [T, k]
        zeros = torch.zeros_like(self.freq[layer])  # [E]
        requests = zeros.index_add(0, flat, torch.ones_like(flat, dtype=zeros.dtype))
        repeats = zeros.index_add(0, flat, repeat.flatten().to(zeros.dtype))
        last = zeros.index_fill(0, ids[-1], 1.0)  # [E] the pass's last token
        self.freq[layer].add_(requests - repeats)
        self.absent[layer].add_(t - (requests - last + observed.float()))  # tokens whose previous lacked e
        before = observed.sum() + (t - 1) * k  # Σ |previous| over the pass's tokens
        self.reuse[layer].add_(torch.stack([repeat.sum(), before]).float())
        observed.zero_().index_fill_(0, ids[-1], True)

    def statistics(self) -> torch.Tensor:
        """The request statistics as one fp32 tensor [L, 2E + 2]: freq, absent, reuse (what `add_statistics`
        merges; a prefill worker's observations of a prompt, sent to decode)."""
        return torch.cat([self.freq, self.absent, self.reuse], dim=1)

    def add_statistics(self, stats: torch.Tensor) -> None:
        """Merge another's `statistics()` (counts of other steps: they add) into these, between steps."""
        e = self.num_experts
        stats = stats.to(self.device)
        self.freq.add_(stats[:, :e])
        self.absent.add_(stats[:, e : 2 * e])
        self.reuse.add_(stats[:, 2 * e :])

    def clear_statistics(self) -> None:
        """Forget every request statistic (a prefill worker's tables, before the next prompt)."""
        for t in (self.freq, self.absent, self.reuse, self.previous, self.observed):
            t.zero_()

    def _rate(self, layer: int) -> torch.Tensor:
        """[E] estimated P(requested by a step | not requested by the step before): the fresh-request rate."""
        return self.freq[layer] / self.absent[layer].clamp(min=1.0)

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

    def _apply(
        self,
        layer: int,
        newcomer: torch.Tensor,
        victims: torch.Tensor,
        valid: torch.Tensor,
        step: int | torch.Tensor,
    ) -> None:
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

    def rebalance(
        self, slots_to_move: int, min_slots: int = 1, max_chunks: int | None = 4, margin: float = 0.25
    ) -> list[tuple[int, int, int]]:
        """Between steps: move slots to the layers where a slot saves the most misses (water-filling).

        The signal is a slot's marginal worth to each layer, from the fresh-request rates (`_rate`: estimated
        requests per step) that every policy keeps for every expert, cached or not:
        - a layer's loss from giving up a chunk: the mean rate of the experts in its next lowest-ranked
          evictable slots (the ones it would give up; a free slot is worth 0);
        - a layer's gain from a chunk more: the mean rate of the absent experts next in line once its free
          slots are filled (the misses that more slots would turn into hits).
        While the largest next gain exceeds (1 + `margin`) × the smallest next loss, that chunk moves. Chunks
        are `slots_to_move` slots (a donor's last may be smaller); in one call a layer gives or takes, not
        both, at most `max_chunks` chunks (None: no limit). `margin` damps moves on noisy estimates (each
        evicts experts). Raw hit rate is the wrong signal: a skewed layer hits often, yet the worth of its
        marginal slot may be above or below a flat layer's. A donor gives up its lowest-scoring unpinned slots
        (their experts are evicted). Reads the tables on the host, so it runs outside captured steps.
        Returns the moves, [(donor, recipient, slots moved)], possibly none.
        """
        n = slots_to_move
        if self.frozen or n <= 0:
            return []
        e, limit = self.num_experts, max_chunks if max_chunks is not None else self.num_slots
        rates = (self.freq / self.absent.clamp(min=1.0)).cpu()  # [L, E], as _rate
        present = (self.slot_of[:, :e] >= 0).cpu()
        order, worth, absent = [], [], []  # per layer: slots it can give (lowest first), their worth; gains
        for layer, slots in enumerate(self.layer_slots):
            owner, key = self._give_order(layer, slots)
            can = max(0, min(slots.numel() - min_slots, int((key < _KEY_MAX).sum()), n * limit))
            lowest = torch.topk(key, can, largest=False).indices
            held = owner[lowest].cpu()
            order.append(lowest)
            worth.append(torch.where(held < 0, 0.0, rates[layer, held.clamp(min=0)]).tolist())
            free = int((owner < 0).sum())
            absent.append(rates[layer][~present[layer]].sort(descending=True).values[free:].tolist())
        given, taken = [0] * self.num_layers, [0] * self.num_layers
        transfers: list[tuple[int, int, int]] = []
        while True:
            # The next chunk's mean worth: a layer that took this call gives nothing, and vice versa.
            loss = sorted(
                (sum(w[given[i] : given[i] + n]) / len(w[given[i] : given[i] + n]), i)
                for i, w in enumerate(worth)
                if given[i] < len(w) and not taken[i]
            )[:2]
            gain = sorted(
                (-sum(a[taken[i] : taken[i] + n]) / len(a[taken[i] : taken[i] + n]), i)
                for i, a in enumerate(absent)
                if taken[i] < min(len(a), n * limit) and not given[i]
            )[:2]
            pairs = [
                (-g - lo, d, r) for lo, d in loss for g, r in gain if d != r and -g > lo * (1.0 + margin)
            ]
            if not pairs:
                break
            _, d, r = max(pairs, key=lambda x: (x[0], -x[1], -x[2]))
            m = min(n, len(worth[d]) - given[d], len(absent[r]) - taken[r])  # never more slots than experts
            transfers.append((d, r, m))
            given[d] += m
            taken[r] += m
        moves: dict[tuple[int, int], int] = {}
        for d, r, m in transfers:
            moves[d, r] = moves.get((d, r), 0) + m
        moved = {d: self.layer_slots[d][order[d][: given[d]]] for d in set(d for d, _, _ in transfers)}
        start = dict.fromkeys(moved, 0)
        for (d, r), m in moves.items():
            self._move(d, r, moved[d][start[d] : start[d] + m])
            start[d] += m
        return [(d, r, m) for (d, r), m in moves.items()]

    def _give_order(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(owners, keys) of `layer`'s `slots`: the order in which the layer gives slots up, lowest key
        first (free slots first, pinned ones never)."""
        owner = self.owner[slots]
        key = torch.where(owner < 0, _KEY_MIN, self._evict_key(owner, slots, self._rate(layer)))
        return owner, torch.where(self.pinned[slots], _KEY_MAX, key)

    def _move(self, donor: int, recipient: int, moved: torch.Tensor) -> None:
        """Move the slots `moved` from the donor to the recipient, evicting their experts."""
        old = self.owner[moved]
        self.slot_of[donor, torch.where(old >= 0, old, self.num_experts)] = -1
        self.slot_of[donor, self.num_experts] = -1
        self.owner[moved] = -1
        kept = self.layer_slots[donor]
        kept = kept[~torch.isin(kept, moved)]
        gained = torch.cat([self.layer_slots[recipient], moved])
        for layer, slots in ((donor, kept), (recipient, gained)):
            self.slot_table[layer].fill_(self.num_slots)
            self.slot_table[layer, : slots.numel()] = slots
            self._capacities[layer] = slots.numel()

    def check(self) -> None:
        """Invariants (tests): no slot owned twice, tables agree, capacities sum to the slot count (less the
        bank's while it is not lent, when its slots hold nothing)."""
        assert self.lent == int(self.lent_mask.sum())
        assert sum(self.capacities) == self.num_slots - self.bank.numel() + self.lent
        if not self.lent:
            assert bool((self.owner[self.bank] < 0).all()), "a reclaimed slot still holds an expert"
        for layer, slots in enumerate(self.layer_slots):
            owners = self.owner[slots]
            held = owners[owners >= 0]
            assert held.unique().numel() == held.numel(), f"layer {layer}: an expert owns two slots"
            assert torch.equal(self.slot_of[layer, held], slots[owners >= 0]), f"layer {layer}: slot_of stale"
            present = (self.slot_of[layer, : self.num_experts] >= 0).nonzero().squeeze(1)
            assert torch.equal(self.owner[self.slot_of[layer, present]], present), (
                f"layer {layer}: owner stale"
            )
            in_layer = torch.zeros(self.num_slots + 1, dtype=torch.bool, device=self.device)
            in_layer[slots] = True
            assert bool(in_layer[self.slot_of[layer, present]].all()), f"layer {layer}: slot of another layer"
