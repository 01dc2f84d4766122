"""EncoderCore's plain stats → Prometheus (the encoder service calls it with its heartbeat, as decode's loop
calls CacheMetricsExporter): the core stays free of metrics, the counters move by difference."""

from __future__ import annotations

import itertools

from common.metrics import EncoderMetrics
from common.workers.encoder import REFUSALS, EncoderCore, EncoderStats


class EncoderMetricsExporter:
    """Moves an EncoderCore's `stats` into EncoderMetrics: counters by what grew since the last `update`,
    each new tower pass once into the histogram, the lent rows as they are now."""

    def __init__(self, core: EncoderCore, metrics: EncoderMetrics) -> None:
        self.core, self.metrics = core, metrics
        self.seen = EncoderStats()
        """The stats as the last `update` found them (only the counts: the pass seconds are the core's)."""
        # an inline core lends nothing: no buffer, no rows to read the lent ones against
        metrics.rows_capacity.set(0 if core.buffer is None else core.capacity)
        for reason in REFUSALS:  # every reason's series from the start: rate() reads 0 there, not nothing
            metrics.requests_refused.labels(reason=reason)

    def update(self) -> None:
        """Call between steps, often enough that fewer than RECENT_PASSES passes run in between."""
        stats, seen, m = self.core.stats, self.seen, self.metrics
        m.images_encoded.inc(stats.images - seen.images)
        m.image_tokens.inc(stats.rows - seen.rows)
        for seconds in self._new_passes(stats.passes - seen.passes):
            m.encode_seconds.observe(seconds)
        for reason, count in stats.refused.items():
            if count > seen.refused.get(reason, 0):
                m.requests_refused.labels(reason=reason).inc(count - seen.refused.get(reason, 0))
        m.rows_lent.set(self.core.rows_lent)
        self.seen = EncoderStats(stats.images, stats.rows, stats.passes, refused=dict(stats.refused))

    def _new_passes(self, new: int) -> list[float]:
        """The seconds of the `new` newest passes (those the core still keeps)."""
        kept = self.core.stats.pass_seconds
        return list(itertools.islice(kept, max(len(kept) - new, 0), None))
