"""ForwardBatch: the tokens of one forward pass over several sequences, laid out flat ([T])."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TypeVar

import torch

from common.ipc.hostmem import host_list_to
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
    position_pair: torch.Tensor
    """[2, T]: `positions` and `rope_positions`, rows of one tensor (a recorded pass's replay copies both at
    once)."""
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
    """Set on a decode pass that a CUDA graph records (common/engine/graphs.py): one token per sequence, and
    the host-side lengths are those of the recording, not of the replays. Layers and backends then take shapes
    from this bound (the most keys any sequence may have) and lengths from the device (`positions`)."""

    kv_bound: int | None = None
    """Set on the chunks of a prompt prefilled in pieces (`ModelRunner.prefill_layer_major`): the most keys
    any chunk of the prompt will see. Buffers that grow with the keys (QSA's indexer scores, 1 GiB a chunk
    at 128K) are allocated at this size and used in part, so that every chunk reuses the caching
    allocator's blocks instead of leaving a larger set behind at each chunk."""

    mrope: torch.Tensor | None = None
    """[3, T] the tokens' multimodal rotary positions (temporal, height, width), where a sequence of the pass
    has a prompt's images (`SequenceState.images`); None: `rope_positions` on all three axes."""
    mrope_table: torch.Tensor | None = None
    """With `mrope`: [3, P] the rotary positions of every token of the pass's one sequence's prompt (a block
    of keys compressed in this pass may start in an earlier pass)."""
    image_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    """(rows [N], embeddings [N, H]): the pass's image tokens, by index into [T], and the embeddings they
    take instead of their token's."""

    @cached_property  # a view made once: the layers read it many times a pass
    def positions(self) -> torch.Tensor:
        """[T] absolute position of each token in its sequence (its KV slot, what it sees)."""
        return self.position_pair[0]

    @cached_property
    def rope_positions(self) -> torch.Tensor:
        """[T] the position each token is rotated at: `positions` plus its sequence's `rope_delta` (a
        prompt's images take fewer positions than tokens; see common/model/qwen4_exp/positions.py)."""
        return self.position_pair[1]

    def rope_at(self, pos: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The rotary positions of sequence positions `pos` [M] (where blocks of keys start), given for each
        a token `rows` [M] of the pass after it in its sequence: [3, M] from the
        prompt's table where the pass has one, else [M] (the row's rotary offset applied: a block that ends
        after a prompt with images starts after its last image: `PromptImages.build` checks)."""
        if self.mrope_table is not None:
            return self.mrope_table[:, pos]
        return pos + (self.rope_positions[rows] - self.positions[rows])

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token to a non-empty cache (and none is a prompt's with images: its
        one token may need the prompt's three-axis rotary positions, which decode's paths do not read)."""
        if self.static_kv is not None:
            return True
        if self.mrope is not None:
            return False
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
            position_pair=self.position_pair[:, start:stop],
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
        deltas = [s.rope_delta for s, q in zip(seqs, query_lens, strict=True) for _ in range(q)]
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
            positions + [p + d for p, d in zip(positions, deltas, strict=True)],
            seq_index,
            table,
            [s.slot for s in seqs],
            slot_mapping,
        ]
        packed = host_list_to([v for part in parts for v in part], device)
        ids, pos, seq, pages, slots, mapping = packed.split([len(part) for part in parts])
        batch = cls(
            input_ids=ids,
            position_pair=pos.view(2, -1),
            seq_index=seq,
            query_lens=query_lens,
            cache_lens=cache_lens,
            page_table=pages.view(len(seqs), max_pages),
            slot_ids=slots,
            page_size=page_size,
            slot_mapping=mapping,
        )
        if any(s.images is not None for s in seqs):
            batch._place_images(seqs)
        return batch

    def _place_images(self, seqs: Sequence[SequenceState]) -> None:
        """Set `mrope`, `mrope_table` and `image_rows` from the one sequence's prompt images."""
        if len(seqs) != 1:
            raise ValueError("a pass over a prompt with images holds that prompt only")
        images, start, n = seqs[0].images, self.cache_lens[0], self.query_lens[0]
        assert images is not None  # `build` places the images of a sequence that has them
        images.mrope = images.mrope.to(self.input_ids.device)  # [3, P], moved once for all its passes
        table = images.mrope
        if start + n > table.shape[1]:
            raise ValueError("a pass with a prompt's images runs within that prompt")
        self.mrope, self.mrope_table = table[:, start : start + n], table
        index = images.token_index  # [N] prompt positions of the image tokens, ascending
        lo, hi = (int(torch.searchsorted(index, v)) for v in (start, start + n))
        if hi > lo:
            rows = (index[lo:hi] - start).to(self.input_ids.device)
            self.image_rows = rows, images.embeds[lo:hi].to(self.input_ids.device)

    def slots_of(self, seq: torch.Tensor | int, pos: torch.Tensor) -> torch.Tensor:
        """Flat paged-state index of position `pos` of batch sequence `seq` (broadcasting)."""
        return self.page_table[seq, pos // self.page_size] * self.page_size + pos % self.page_size
