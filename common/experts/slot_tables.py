"""Which expert sits in which slot of the VRAM expert cache, as device tables (`SlotTables`, the base of
`CacheTables`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class SlotTables:
    """S slots partitioned by layer (a slot serves one layer until capacity moves): `slot_of[layer, expert]`
    (−1: absent), `owner[slot]` (expert or −1), `last_use[slot]`, `pinned[slot]` (never evicted), and each
    layer's slot list `slot_table[layer, :capacity]`. Every table has one spare entry at its end that absorbs
    the writes of invalid pairs. Pool rows: [0, S) the slots, S the spare row, then E staging rows."""

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        slots_per_layer: Sequence[int],
        lendable: int,
        device: torch.device | str,
    ) -> None:
        """`lendable` slots beyond the layers' capacities: the bank (`SlotCapacity`), in no layer's list."""
        if len(slots_per_layer) != num_layers:
            raise ValueError(f"{len(slots_per_layer)} layer capacities for {num_layers} layers")
        self.num_layers, self.num_experts = num_layers, num_experts
        self.num_slots = sum(slots_per_layer) + lendable
        self.device = torch.device(device)
        s, e = self.num_slots, num_experts
        self.slot_of = torch.full((num_layers, e + 1), -1, dtype=torch.int64, device=device)  # col e: spare
        self.owner = torch.full((s + 1,), -1, dtype=torch.int64, device=device)  # slot s: spare
        self.last_use = torch.zeros(s + 1, dtype=torch.int64, device=device)
        self.pinned = torch.zeros(s + 1, dtype=torch.bool, device=device)
        # Layer l's slots are slot_table[l, :capacity[l]], the rest of the row is the spare slot: a fixed
        # shape that rebalance rewrites in place, so a recorded step stays valid when capacities move.
        self.slot_table = torch.full((num_layers, e), s, dtype=torch.int64, device=device)
        self._capacities: list[int] = []
        self._assign(list(slots_per_layer))

    @property
    def capacities(self) -> list[int]:
        return list(self._capacities)

    @property
    def layer_slots(self) -> list[torch.Tensor]:
        """Each layer's slots (views of `slot_table`)."""
        return [self.slot_table[layer, :c] for layer, c in enumerate(self._capacities)]

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

    def _set_layer_slots(self, layer: int, slots: torch.Tensor) -> None:
        """Between steps: `slots` become layer's list (its capacity), the rest of its row the spare slot."""
        self.slot_table[layer].fill_(self.num_slots)
        self.slot_table[layer, : slots.numel()] = slots
        self._capacities[layer] = slots.numel()

    def pin(self, layer: int, experts: Sequence[int]) -> None:
        """Load-time: give `experts` of `layer` slots that are never evicted (they must still be filled)."""
        slots = self.layer_slots[layer][: len(experts)]
        if len(slots) < len(experts):
            raise ValueError(f"layer {layer}: {len(experts)} pinned experts, {len(slots)} slots")
        ids = torch.tensor(list(experts), dtype=torch.int64, device=self.device)
        self.owner[slots] = ids
        self.slot_of[layer, ids] = slots
        self.pinned[slots] = True

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

    def _check_layers(self) -> None:
        """Invariants (tests): no slot owned twice, slot_of and owner agree, each layer's experts in its
        own slots."""
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
