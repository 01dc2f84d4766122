"""KV lending: the KV pool's idle pages serve as expert-cache slots until a sequence needs them.

A pool sized for `--max-context` × lanes is mostly empty while contexts are short. The KV pages' memory is
mapped a second time as extra rows of the expert pool (common/ipc/aliased.py), the cache tables' bank
(`CacheTables.lend` / `reclaim`). Who owns a byte is decided by one number, the page allocator's `limit`:
pages below it belong to the KV pool, and the bank slots whose bytes lie only in pages at or above it belong
to the cache. The limit moves in stages (an eighth of the pool by default):
- up, when a reservation needs a page at or above it: the bank slots below the new limit are reclaimed
  (their experts evicted) first, between steps, so the step that writes the page is the first to use it;
- down, when sequences finish and the pages in use end a stage and more below it: the freed stages' slots
  are lent (they start empty; their bytes are whatever the KV pages held).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.experts.cache_tables import CacheTables
from common.ipc.aliased import AliasedMemory
from common.kv.state import PagedSpec, StatePool, StateSpec

Components = dict[str, tuple[tuple[int, ...], torch.dtype]]
"""An expert pool's components: name → (one row's shape, dtype) (HostExpertStore.components)."""

STAGES = 8
"""Steps the KV limit moves in: one stage is this fraction of the pool's pages."""


def _chunks(unit_bytes: Sequence[int], first: int, count: int, chunk: int) -> list[tuple[int, int, int, int]]:
    """Every whole chunk inside units [first, first + count) of each tensor (unit_bytes[i] bytes a unit), as
    (first unit touched, tensor index, byte offset, end unit touched), in that order."""
    out = []
    for i, u in enumerate(unit_bytes):
        start = -(-first * u // chunk) * chunk
        for at in range(start, (first + count) * u // chunk * chunk, chunk):
            out.append((at // u, i, at, -(-(at + chunk) // u)))
    out.sort()
    return out


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


class KvLending:
    """The KV pool's paged tensors, built over a shared buffer, and the lending of their idle pages.

    Both sides map the shared buffer in whole chunks (the mapping granularity), each side's chunks ordered
    by the first unit they touch (pages for the KV tensors, rows for the expert components): chunk k holds
    low pages for small k on the KV side and low bank rows on the expert side, so a bank slot's bytes lie in
    pages of about one position and lowering the limit by a stage lends about a stage's worth of slots. A
    piece of a row or page that does not fill a chunk is the tensor's own memory (at most two a tensor)."""

    def __init__(
        self,
        layer_specs: list[dict[str, StateSpec]],
        num_pages: int,
        page_size: int,
        device: torch.device | str,
        stages: int = STAGES,
    ) -> None:
        """The same specs, pages and page size as the StatePool that will hold `paged`."""
        self.num_pages = num_pages
        self._keys = [
            (i, name, (num_pages, page_size, *s.token_shape), s.dtype)
            for i, specs in enumerate(layer_specs)
            for name, s in specs.items()
            if isinstance(s, PagedSpec)
        ]
        if not self._keys:
            raise ValueError("KV lending needs paged state (attention K/V); this model keeps none")
        page_bytes = [_nbytes(shape[1:], dtype) for _, _, shape, dtype in self._keys]
        chunk = AliasedMemory.granularity(device)
        self._kv_chunks = _chunks(page_bytes, 0, num_pages, chunk)
        self.memory = AliasedMemory(len(self._kv_chunks) * chunk, device)
        self.paged: list[dict[str, torch.Tensor]] = [{} for _ in layer_specs]
        """Each layer's paged tensors [pages, page_size, *token_shape] (StatePool's `paged`)."""
        for t, (i, name, shape, dtype) in enumerate(self._keys):
            pieces = [(at, chunk, k * chunk) for k, (_, j, at, _) in enumerate(self._kv_chunks) if j == t]
            raw = self.memory.tensor(_nbytes(shape, dtype), pieces)
            self.paged[i][name] = raw.view(dtype).view(shape)
        self.stages = [-(-num_pages * s // stages) for s in range(1, stages + 1)]
        """The limits the page allocator moves between."""
        self.first_page = torch.zeros(0, dtype=torch.int64)
        """[bank] the lowest KV page each bank slot's bytes lie in (`expert_pool` sets it)."""
        self.first_row = 0
        """The bank's first pool row (= slot)."""
        self.tables: CacheTables | None = None
        self.pool: StatePool | None = None
        self.raises = self.lowers = 0
        """Times the limit went up (slots reclaimed) and down (slots lent)."""

    def _bank_chunks(
        self, components: Components, first_row: int, bank: int
    ) -> list[tuple[int, int, int, int]]:
        rows = [_nbytes(shape, dtype) for shape, dtype in components.values()]
        return _chunks(rows, first_row, bank, self.memory.chunk)

    def bank_size(self, components: Components, first_row: int) -> int:
        """The bank slots the shared buffer holds: as many as whole slots fit its bytes (their whole chunks
        are then at most the buffer's)."""
        return self.memory.shared_bytes // sum(_nbytes(shape, dtype) for shape, dtype in components.values())

    def expert_pool(
        self, components: Components, rows: int, first_row: int, bank: int
    ) -> dict[str, torch.Tensor]:
        """The expert pool's components [rows, *shape], rows [first_row, first_row + bank) over the shared
        buffer (as far as whole chunks go), the rest their own memory. Notes each bank slot's first page:
        the lowest KV page any of its bytes is (`first_page`, what `bind` lends by)."""
        chunk, names = self.memory.chunk, list(components)
        ex = self._bank_chunks(components, first_row, bank)
        base = len(self._kv_chunks) - len(ex)  # the bank's chunks alias the last (highest) pages
        assert base >= 0, "bank_size gives a bank whose whole chunks fit the shared buffer"
        first_page = torch.full((bank,), self.num_pages, dtype=torch.int64)  # no byte shared: no page
        pool = {}
        for c, name in enumerate(names):
            shape, dtype = components[name]
            pieces = [(at, chunk, (base + k) * chunk) for k, (_, j, at, _) in enumerate(ex) if j == c]
            raw = self.memory.tensor(rows * _nbytes(shape, dtype), pieces)
            pool[name] = raw.view(dtype).view(rows, *shape)
        for k, (lo, _, _, hi) in enumerate(ex):
            page = self._kv_chunks[base + k][0]
            rows_hit = slice(max(lo, first_row) - first_row, min(hi, first_row + bank) - first_row)
            first_page[rows_hit] = first_page[rows_hit].clamp(max=page)
        self.first_page, self.first_row = first_page, first_row
        return pool

    def bind(self, tables: CacheTables, pool: StatePool) -> None:
        """Start lending: the allocator's limit at the first stage, every bank slot above it lent."""
        for layer, mine in zip(pool.layers, self.paged, strict=True):
            if any(layer.paged[name] is not t for name, t in mine.items()):
                raise ValueError("the state pool does not hold this lending's paged tensors")
        self.tables, self.pool = tables, pool
        pool.pages.limit = self.stages[0]
        pool.pages.on_short, pool.pages.on_free = self.grow, self.shrink
        tables.lend(self._slots(self.first_page >= pool.pages.limit))

    def _bound(self) -> tuple[CacheTables, StatePool]:
        """The tables and pool `bind` gave."""
        assert self.tables is not None and self.pool is not None, "bind first"
        return self.tables, self.pool

    def _slots(self, which: torch.Tensor) -> torch.Tensor:
        """The bank slots `which` selects, those of the highest pages first (lent first: the last needed)."""
        index = which.nonzero().flatten()
        index = index[torch.argsort(self.first_page[index], descending=True, stable=True)]
        return (self.first_row + index).to(self._bound()[0].device)

    @property
    def limit(self) -> int:
        return self._bound()[1].pages.limit

    def grow(self, needed: int) -> None:
        """The allocator needs pages below `needed`: raise the limit to the stage above the one that holds
        them (a stage of headroom: lanes keep growing while a prefill holds the cache frozen), after taking
        back the bank slots below it. Not while another process reads the frozen cache: the allocation is
        then refused (PoolExhausted) and asked again after the thaw."""
        tables, pool = self._bound()
        at = next(i for i, s in enumerate(self.stages) if s >= needed)
        new = self.stages[min(at + 1, len(self.stages) - 1)]
        if needed <= self.limit or (tables.frozen and tables.readers):
            return
        tables.reclaim(self._slots((self.first_page >= self.limit) & (self.first_page < new)))
        pool.pages.limit = new
        self.raises += 1

    def shrink(self) -> None:
        """Pages were freed: lower the limit to one stage above the stage the pages in use end in (to the
        first stage when none is), and lend what that frees."""
        tables, pool = self._bound()
        used = pool.pages.high_water()
        at = next(i for i, s in enumerate(self.stages) if s >= max(used, 1))
        new = self.stages[min(at + 1, len(self.stages) - 1)] if used else self.stages[0]
        if new >= self.limit:
            return
        tables.lend(self._slots((self.first_page >= new) & (self.first_page < self.limit)))
        pool.pages.limit = new
        self.lowers += 1
