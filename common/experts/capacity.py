"""How many slots each layer of the expert cache holds (`SlotCapacity`, a base of `CacheTables`): the bank of
lendable slots that another user (the prefill arena, the KV pool's idle pages) holds at times and lends to
the layers while it is idle, and the rebalancing that moves slots to the layers where they are worth most.
Both run between steps, on the host: a recorded step reads the slot lists in place."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.experts.eviction import KEY_MAX, EvictionPolicy


class SlotCapacity(EvictionPolicy):
    """Per-layer capacity: lending (`lend`, `reclaim`) and rebalancing (`rebalance`)."""

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
        """`lendable` slots beyond the layers' capacities are the bank (`lend`, `reclaim`)."""
        super().__init__(num_layers, num_experts, slots_per_layer, lendable, device, decay, policy)
        self.bank = torch.arange(self.num_slots - lendable, self.num_slots, device=device)
        """The lendable slots (the last ones): in no layer's list until `lend`, again after `reclaim`."""
        self.lent_mask = torch.zeros(self.num_slots + 1, dtype=torch.bool, device=device)
        """The bank slots the layers hold now."""
        self.lent = 0
        """How many: a host count, so the whole-bank `lend` of each arena-lending pass returns unsynced."""
        self.readers = False
        """Another process reads the slots in place while the cache is frozen (a serving decode worker's
        prefill): lent slots cannot be reclaimed then. Without readers a freeze only keeps a pass from
        leaving a trace (`OffloadedExperts.untracked`), and reclaiming is safe."""

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
            self._set_layer_slots(layer, held_slots[~lent])
        self.owner[take] = -1
        self.last_use[take] = 0
        self.lent_mask[take] = False
        self.lent -= take.numel()
        for layer in range(self.num_layers):
            if self._capacities[layer] == 0:
                donor = max(range(self.num_layers), key=lambda d: self._capacities[d])
                donor_slots = self.layer_slots[donor]
                _, key = self._give_order(donor, donor_slots)
                if self._capacities[donor] > 1 and int(key.min()) < KEY_MAX:
                    self._move(donor, layer, donor_slots[key.argmin()].reshape(1))
        if self.readers and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def rebalance(
        self, slots_to_move: int, min_slots: int = 1, max_chunks: int | None = 4, margin: float = 0.25
    ) -> list[tuple[int, int, int]]:
        """Between steps: move slots to the layers where a slot saves the most misses (water-filling).

        The signal is a slot's marginal worth to each layer, from the fresh-request rates (`_rate`) that
        every policy keeps for every expert: a layer's loss from giving up a chunk is the mean rate of the
        experts in its next lowest-ranked evictable slots (a free slot is worth 0); its gain from a chunk
        more, the mean rate of the absent experts next in line once its free slots are filled. While the
        largest next gain exceeds (1 + `margin`) × the smallest next loss, that chunk moves. Chunks are
        `slots_to_move` slots (a donor's last may be smaller); in one call a layer gives or takes, not both,
        at most `max_chunks` chunks (None: no limit). Host reads: outside captured steps. → the moves,
        [(donor, recipient, slots moved)], possibly none.
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
            can = max(0, min(slots.numel() - min_slots, int((key < KEY_MAX).sum()), n * limit))
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
            self._set_layer_slots(layer, slots)

    def _check_bank(self) -> None:
        """Invariants (tests): the lent count, capacities summing to the slots less the bank's while it is
        not lent, when its slots hold nothing."""
        assert self.lent == int(self.lent_mask.sum())
        assert sum(self.capacities) == self.num_slots - self.bank.numel() + self.lent
        if not self.lent:
            assert bool((self.owner[self.bank] < 0).all()), "a reclaimed slot still holds an expert"
