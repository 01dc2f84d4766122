"""Expert cache and arena counters → Prometheus (read between steps: the counters live on the device)."""

from __future__ import annotations

from common.experts.offload import OffloadedExperts
from common.metrics import ExpertCacheMetrics


class CacheMetricsExporter:
    """Moves the per-layer device counters of an OffloadedExperts into ExpertCacheMetrics by difference."""

    def __init__(self, offload: OffloadedExperts, metrics: ExpertCacheMetrics) -> None:
        self.offload, self.metrics = offload, metrics
        self.layers = [str(layer) for layer in sorted(offload.index, key=offload.index.__getitem__)]
        m = metrics
        self.counters = {"hits": m.hits, "misses": m.misses, "evictions": m.evictions, "bypasses": m.bypasses,
                         "prefetches": m.prefetches, "prefetch_hits": m.prefetch_hits}  # fmt: skip
        for counter in self.counters.values():  # every layer's series from the start (0 until it counts)
            for layer in self.layers:
                counter.labels(layer=layer)
        self.seen = {name: [0] * len(self.layers) for name in self.counters}
        self.bytes_seen = self.loads_seen = 0

    def update(self) -> None:
        """Call between steps (it synchronises with the device)."""
        counters = {name: t.tolist() for name, t in self.offload.tables.counters.items()}
        delta = {n: [a - b for a, b in zip(counters[n], self.seen[n], strict=True)] for n in self.seen}
        self.seen = {n: counters[n] for n in self.seen}
        m = self.metrics
        for i, layer in enumerate(self.layers):
            for name, counter in self.counters.items():
                if delta[name][i]:
                    counter.labels(layer=layer).inc(delta[name][i])
            lookups = delta["hits"][i] + delta["misses"][i]
            if lookups:
                m.hit_rate.labels(layer=layer).set(delta["hits"][i] / lookups)
        for i, capacity in enumerate(self.offload.tables.capacities):
            m.slots.labels(layer=self.layers[i]).set(capacity)
        m.lent_bytes.set(self.offload.tables.lent * self.offload.store.expert_bytes)
        traffic = self.offload.traffic()
        moved = sum(traffic.cache_bytes) + sum(traffic.bypass_bytes) + sum(traffic.arena_bytes)
        moved += sum(traffic.prefetch_bytes)
        loads = sum(traffic.arena_loads)
        m.h2d_bytes.inc(moved - self.bytes_seen)
        m.arena_loads.inc(loads - self.loads_seen)
        self.bytes_seen, self.loads_seen = moved, loads
