"""CacheFreeze: prefill's hold on decode's expert cache, and the bank lent between prefills.

Prefill reads decode's expert cache in place while it holds a freeze (from the grant of its state to `Thaw`,
`PrefillDone` or the request's end): no insertions or evictions meanwhile. With `lend_arena`, prefill's arena
lives in decode's expert pool as the cache tables' bank: taken back when the first freeze starts (prefill
copies its experts there from the grant on), lent to the cache again when the last one ends.
"""

from __future__ import annotations

from common.experts.offload import OffloadedExperts


class CacheFreeze:
    """The holders of freezes on one expert cache (None: the experts are resident, nothing to freeze)."""

    def __init__(self, offload: OffloadedExperts | None, lend_arena: bool) -> None:
        self.offload, self.lend_arena = offload, lend_arena
        self.holders: set[str] = set()
        self.bank_ready = False
        """With `lend_arena`: the bank (prefill's arena) is lent whenever the last freeze ends, once the
        running prefill worker has been granted one (it asks for state only after its warm-up, which writes
        its arena unfrozen). A (re)started prefill sets it back (`DecodeCore.prefill_restarted`)."""
        if offload is not None:  # prefill reads the cache in place while frozen
            offload.tables.readers = True

    def set(self, holder: str, on: bool) -> None:
        """Start (`on`) or end `holder`'s freeze. The caller lands the launched steps before a freeze starts,
        so their copies have completed when it is granted."""
        was = bool(self.holders)
        (self.holders.add if on else self.holders.discard)(holder)
        if self.offload is None:
            return
        if self.holders and not was:
            self.take_bank()  # prefill copies its experts there from the grant on
        self.bank_ready |= on  # a grant: the prefill that asked for it is past its warm-up
        self.offload.tables.frozen = bool(self.holders)
        if was and not self.holders and self.bank_ready and self.lend_arena:
            self.offload.tables.lend()

    def take_bank(self) -> None:
        """With `lend_arena`: evict the cache from prefill's arena rows (landed on the device before a grant
        or the exports let prefill write them: the tables have readers)."""
        if self.lend_arena and self.offload is not None:
            self.offload.tables.reclaim()
