"""ForwardBatch: the tokens of one forward pass over several sequences, laid out flat ([T])."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from common.hostmem import host_list_to
from common.kv.state import SequenceState

T = TypeVar("T")


@dataclass
class ForwardBatch:
    """A flat batch: sequence b contributes `query_lens[b]` tokens after `cache_lens[b]` cached ones.

    Tokens are ordered sequence by sequence. Host-side lengths are kept as lists because every backend
    needs them to plan; device tensors are what the layers read.
    """

    input_ids: torch.Tensor
    """[T] token ids."""
    positions: torch.Tensor
    """[T] absolute position of each token in its sequence."""
    seq_index: torch.Tensor
    """[T] which sequence of the batch each token belongs to."""
    query_lens: list[int]
    """New tokens per sequence."""
    cache_lens: list[int]
    """Tokens already cached per sequence before this pass."""
    page_table: torch.Tensor
    """[B, max_pages] page ids of each sequence (padded with 0)."""
    slot_ids: torch.Tensor
    """[B] fixed-size state slot of each sequence."""
    page_size: int
    """Tokens per page."""
    slot_mapping: torch.Tensor
    """[T] flat index (page · page_size + offset) of each token in every paged state tensor."""
    static_kv: int | None = None
    """Set on a decode pass that a CUDA graph records (common/graphs.py): one token per sequence, and the
    host-side lengths are those of the recording, not of the replays. Layers and backends then take shapes
    from this bound (the most keys any sequence may have) and lengths from the device (`positions`)."""

    kv_bound: int | None = None
    """Set on the chunks of a prompt prefilled in pieces (`ModelRunner.prefill_layer_major`): the most keys
    any chunk of the prompt will see. Buffers that grow with the keys (QSA's indexer scores, 1 GiB a chunk
    at 128K) are allocated at this size and used in part, so that every chunk reuses the caching
    allocator's blocks instead of leaving a larger set behind at each chunk."""

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token to a non-empty cache."""
        if self.static_kv is not None:
            return True
        return all(q == 1 for q in self.query_lens) and all(c > 0 for c in self.cache_lens)

    @property
    def kv_lens(self) -> list[int]:
        return [c + q for c, q in zip(self.cache_lens, self.query_lens, strict=True)]

    def per_pass(self, key: str, build: Callable[[], T]) -> T:
        """What every layer of this pass derives alike from the batch (paddings, a kernel's varlen
        arguments): `build()` the first time a layer asks for `key`, the same object after."""
        memo = self.__dict__.setdefault("_per_pass", {})
        if key not in memo:
            memo[key] = build()
        return memo[key]

    def lanes(self, start: int, stop: int) -> ForwardBatch:
        """A decode pass's sequences [start, stop) as a batch of their own, its tensors views of these (a
        recorded pass's replays fill them)."""
        if not self.is_decode:
            raise ValueError("only a decode pass (one token a sequence) splits into lanes")
        n = stop - start
        return ForwardBatch(
            input_ids=self.input_ids[start:stop],
            positions=self.positions[start:stop],
            seq_index=torch.arange(n, device=self.input_ids.device),
            query_lens=self.query_lens[start:stop],
            cache_lens=self.cache_lens[start:stop],
            page_table=self.page_table[start:stop],
            slot_ids=self.slot_ids[start:stop],
            page_size=self.page_size,
            slot_mapping=self.slot_mapping[start:stop],
            static_kv=self.static_kv,
        )

    def last_token_index(self) -> torch.Tensor:
        """[B] index into [T] of each sequence's last token."""
        ends = host_list_to(self.query_lens, self.input_ids.device).cumsum(0)
        return ends - 1

    @classmethod
    def build(
        cls,
        seqs: Sequence[SequenceState],
        tokens: Sequence[Sequence[int]],
        page_size: int,
        device: torch.device | str,
    ) -> ForwardBatch:
        """Batch `tokens[b]` appended to `seqs[b]` (whose pages must already cover them). The index tensors
        are views of one tensor copied to the device at once: a copy costs the step a few µs however small,
        and a decode step has six."""
        query_lens = [len(t) for t in tokens]
        cache_lens = [s.num_cached for s in seqs]
        positions = [p for c, q in zip(cache_lens, query_lens, strict=True) for p in range(c, c + q)]
        seq_index = [b for b, q in enumerate(query_lens) for _ in range(q)]
        max_pages = max(len(s.pages) for s in seqs)
        table = [p for s in seqs for p in s.pages + [0] * (max_pages - len(s.pages))]
        slot_mapping = [
            s.pages[p // page_size] * page_size + p % page_size
            for s, c, q in zip(seqs, cache_lens, query_lens, strict=True)
            for p in range(c, c + q)
        ]
        parts = [
            [t for ts in tokens for t in ts],
            positions,
            seq_index,
            table,
            [s.slot for s in seqs],
            slot_mapping,
        ]
        packed = host_list_to([v for part in parts for v in part], device)
        ids, pos, seq, pages, slots, mapping = packed.split([len(part) for part in parts])
        return cls(
            input_ids=ids,
            positions=pos,
            seq_index=seq,
            query_lens=query_lens,
            cache_lens=cache_lens,
            page_table=pages.view(len(seqs), max_pages),
            slot_ids=slots,
            page_size=page_size,
            slot_mapping=mapping,
        )

    def slots_of(self, seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Flat paged-state index of position `pos` of batch sequence `seq` (broadcasting)."""
        return self.page_table[seq, pos // self.page_size] * self.page_size + pos % self.page_size
