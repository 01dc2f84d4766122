"""ModelRunner: steps a model over sequences whose state lives in a StatePool."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from common.kv.backend import AttentionBackend, TorchPagedBackend
from common.kv.batch import ForwardBatch
from common.kv.state import Allocator, SequenceState, StatePool
from common.model.context import ForwardContext


def num_pages(max_seqs: int, max_context: int, page_size: int) -> int:
    """KV pages of a state pool: every lane can hold a full context at once (the memory plan sizes the KV
    pool with this too, so the plan and the pool cannot disagree)."""
    return max_seqs * -(-max_context // page_size)


class ModelRunner:
    """Owns the state pool of a model and runs forward passes that append tokens to sequences."""

    def __init__(
        self,
        model: nn.Module,
        max_seqs: int,
        max_context: int,
        page_size: int = 16,
        backend: AttentionBackend | None = None,
        kv_dtype: torch.dtype | None = None,
        allocate: Allocator | None = None,
    ) -> None:
        """`allocate` makes the state pool's tensors (see StatePool)."""
        param = next(model.parameters())
        self.model, self.device = model, param.device
        self.backend = backend or TorchPagedBackend()
        specs = model.state_specs(kv_dtype or param.dtype)
        pages = num_pages(max_seqs, max_context, page_size)
        self.pool = StatePool(specs, pages, page_size, max_seqs, self.device, allocate)
        self.max_context = max_context

    def new_sequence(self) -> SequenceState:
        return self.pool.new_sequence()

    def release(self, seq: SequenceState) -> None:
        self.pool.release(seq)

    @torch.inference_mode()
    def forward(
        self, seqs: Sequence[SequenceState], tokens: Sequence[Sequence[int]], all_logits: bool = False
    ) -> torch.Tensor:
        """Append `tokens[b]` to `seqs[b]`; logits [B, V] of each last token, or [T, V] of every token."""
        ctx = self._context(seqs, tokens)
        hidden = self.model(ctx)  # [T, H]
        self._advance(seqs, tokens)
        return self.model.compute_logits(hidden if all_logits else hidden[ctx.batch.last_token_index()])

    @torch.inference_mode()
    def forward_streams(self, seqs: Sequence[SequenceState], tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        """Like forward, but return every token's pre-mixer streams [T, hc·H] (models with an MTP head)."""
        ctx = self._context(seqs, tokens)
        streams = self.model.forward_streams(ctx)
        self._advance(seqs, tokens)
        return streams

    @torch.inference_mode()
    def draft(
        self, seqs: Sequence[SequenceState], next_tokens: Sequence[Sequence[int]], streams: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP rows at positions seqs[b].num_cached...: (draft logits [T, V], MTP streams [T, hc·H]).

        Does not advance `seqs`: the caller decides which MTP rows are final.
        """
        return self.model.draft(streams, self._context(seqs, next_tokens))

    def _context(self, seqs: Sequence[SequenceState], tokens: Sequence[Sequence[int]]) -> ForwardContext:
        for seq, toks in zip(seqs, tokens, strict=True):
            total = seq.num_cached + len(toks)
            if total > self.max_context:
                raise ValueError(f"sequence of {total} tokens exceeds the context of {self.max_context}")
            self.pool.reserve(seq, total)
        batch = ForwardBatch.build(seqs, tokens, self.pool.page_size, self.device)
        self.model.experts.begin_pass(batch.is_decode)
        return ForwardContext(batch, self.pool, self.backend, self.backend.plan(batch))

    @staticmethod
    def _advance(seqs: Sequence[SequenceState], tokens: Sequence[Sequence[int]]) -> None:
        for seq, toks in zip(seqs, tokens, strict=True):
            seq.num_cached += len(toks)
