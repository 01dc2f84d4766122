"""Host → device expert traffic: device counters per MoE layer (added to inside steps, no sync) and their
report in bytes (read between steps)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

FILLS, BYPASSES, ARENA, LOADS = range(4)
"""Rows of the device counters of experts moved ([TRAFFIC_ROWS, L] int64)."""
TRAFFIC_ROWS = LOADS + 1


def traffic_counts(num_layers: int, device: torch.device) -> torch.Tensor:
    """Zeroed device counters of experts moved: [TRAFFIC_ROWS, L] int64 (rows FILLS … LOADS)."""
    return torch.zeros(TRAFFIC_ROWS, num_layers, dtype=torch.int64, device=device)


@dataclass
class TrafficCounters:
    """Host → device traffic per MoE layer, as host ints (read from device counters between steps)."""

    cache_bytes: list[int]
    """Misses copied into a cache slot."""
    arena_bytes: list[int]
    """Experts copied into the prefill arena (whole layers streamed ahead too, used or not)."""
    arena_loads: list[int]
    """Arena copy launches that moved at least one expert."""
    bypass_bytes: list[int]
    """Bypassed misses copied into a staging row (for one step)."""
    prefetch_bytes: list[int]
    """Experts copied into a cache slot ahead of their layer's step (`OffloadedExperts.lookahead`; the
    tables' `prefetches` counter)."""

    @classmethod
    def read(cls, moved: torch.Tensor, prefetches: torch.Tensor, expert_bytes: int) -> TrafficCounters:
        """From the counters `moved` ([TRAFFIC_ROWS, L]) and `prefetches` ([L]): reads the device (a sync)."""
        fills, bypasses, arena, loads = moved.tolist()
        b = expert_bytes
        return cls(
            cache_bytes=[n * b for n in fills],
            arena_bytes=[n * b for n in arena],
            arena_loads=loads,
            bypass_bytes=[n * b for n in bypasses],
            prefetch_bytes=[n * b for n in prefetches.tolist()],
        )
