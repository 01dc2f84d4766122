"""The expert cache's request statistics, per layer and expert, cached or not (`RequestStats`, a base of
`CacheTables`): what its policies and capacity moves estimate future requests from."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.experts.slot_tables import SlotTables
from common.model.groups import DECODE_GROUPS


class RequestStats(SlotTables):
    """Decayed counts of fresh requests (`freq`: not also requested by the layer's previous step) and of the
    steps that could have made one (`absent`), so freq / absent estimates P(requested | not requested by the
    previous step); per layer, decayed counts of [experts requested again by the next step, experts
    requested] (`reuse`). They decay by `decay` per step of their layer; a prompt's tokens count as steps
    too (`observe`: added, undecayed)."""

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        slots_per_layer: Sequence[int],
        lendable: int,
        device: torch.device | str,
        decay: float,
    ) -> None:
        super().__init__(num_layers, num_experts, slots_per_layer, lendable, device)
        self.decay, e = decay, num_experts
        self.freq = torch.zeros(num_layers, e, dtype=torch.float32, device=device)
        self.previous = torch.zeros(DECODE_GROUPS, num_layers, e, dtype=torch.bool, device=device)
        """The previous step's requests, per decode group (`resolve`)."""
        self.groups = 1
        """The groups of the decode passes served now (`regroup`)."""
        self.absent = torch.zeros(num_layers, e, dtype=torch.float32, device=device)
        self.reuse = torch.zeros(num_layers, 2, dtype=torch.float32, device=device)
        self.observed = torch.zeros(num_layers, e, dtype=torch.bool, device=device)
        """The last prompt token `observe` counted, per layer (a prompt's own previous step)."""
        self.decay_on_device = torch.tensor(decay, dtype=torch.float32, device=device)

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
        then decay them as their own), without touching slots, recency or decode's previous step: decode
        starts with rates counted over the prompt instead of from nothing. A token's previous step is the
        token observed before it in the layer (`observed`: the previous pass's last, across prompts too).
        Counted from the ids, not from [T, E] masks (a few launches a pass, whatever T): a token's repeats
        are its choices among the previous token's ([T, k, k] compares), an expert's requests a
        scatter-add."""
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
