"""Greedy speculative decoding with a model's MTP head: draft K tokens, verify them in one trunk pass.

Each round, per sequence: the trunk runs [last token, d1..dK] in one pass and its argmax at each position is
the token greedy decoding would emit; drafts are accepted while they agree, and the first disagreement (or
the token after the last draft) is emitted too, so the output equals greedy decoding without drafts. On a
rejection every fixed-size state (recurrent, conv, n-gram) is restored from a snapshot and the trunk re-runs
the accepted tokens; paged state (K/V, indexer keys) rolls back by length. The MTP head then catches up on
the trunk's true hidden states (row p pairs trunk streams h_p with token p+1) and drafts the next K.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from common.engine.model_api import as_mtp
from common.engine.runner import ModelRunner
from common.kv.state import SequenceState


@dataclass
class _Drafts:
    mtp_cached: int
    """MTP rows written from the trunk's true hidden states (= the trunk's cached length)."""
    tokens: list[int] = field(default_factory=list)


class MTPSpeculator:
    """Drafts with the MTP head and verifies with the trunk; tracks each sequence's drafts by slot."""

    def __init__(self, runner: ModelRunner, num_draft: int) -> None:
        if getattr(runner.model, "mtp", None) is None:
            raise ValueError("speculative decoding with MTP needs a model loaded with its MTP head")
        self.runner, self.model, self.num_draft = runner, as_mtp(runner.model), num_draft
        self.drafts: dict[int, _Drafts] = {}

    def prefill(self, seqs: Sequence[SequenceState], prompts: Sequence[Sequence[int]]) -> list[int]:
        """Prefill the prompts; return each first (greedy) token and prepare its drafts."""
        streams = self.runner.forward_streams(seqs, prompts, prompt=True)  # [T, hc·H]
        ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
        first = self._greedy(streams[ends.to(streams.device)]).tolist()
        starts = [0] * len(seqs)
        self._catch_up(seqs, starts, [[*p[1:], t] for p, t in zip(prompts, first, strict=True)], streams)
        return first

    def step(self, seqs: Sequence[SequenceState], last: Sequence[int]) -> list[list[int]]:
        """One round for every sequence; returns the tokens each emits (1 to K+1)."""
        pool = self.runner.pool
        lens = [s.num_cached for s in seqs]
        room = self.runner.max_context - 1  # a verification of [last, d1..dK] must fit
        drafts = [self.drafts[s.slot].tokens[: max(0, room - s.num_cached)] for s in seqs]
        snaps = [pool.snapshot(s) for s in seqs]
        inputs = [[t, *d] for t, d in zip(last, drafts, strict=True)]
        streams = self.runner.forward_streams(seqs, inputs)
        targets = self._greedy(streams).tolist()
        emitted, rows, offset = [], [], 0
        for d, inp in zip(drafts, inputs, strict=True):
            want = targets[offset : offset + len(inp)]
            accepted = 0
            while accepted < len(d) and d[accepted] == want[accepted]:
                accepted += 1
            emitted.append([*d[:accepted], want[accepted]])
            rows.append(torch.arange(offset, offset + accepted + 1))
            offset += len(inp)
        redo = [b for b, e in enumerate(emitted) if len(e) < len(inputs[b])]
        if redo:  # roll back and re-run only what was accepted
            for b in redo:
                pool.restore(seqs[b], snaps[b], lens[b])
            kept = [inputs[b][: len(emitted[b])] for b in redo]
            again = self.runner.forward_streams([seqs[b] for b in redo], kept)
            offsets = list(itertools.accumulate(len(k) for k in kept))
            for i, b in enumerate(redo):
                rows[b] = torch.arange(offsets[i] - len(kept[i]), offsets[i]) + streams.shape[0]
            streams = torch.cat([streams, again])
        index = torch.cat(rows).to(streams.device)
        self._catch_up(seqs, lens, emitted, streams[index])
        return emitted

    def release(self, seq: SequenceState) -> None:
        self.drafts.pop(seq.slot, None)

    def _greedy(self, streams: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(self.model.mix(streams)).argmax(dim=-1)

    def _catch_up(
        self,
        seqs: Sequence[SequenceState],
        starts: Sequence[int],
        nexts: Sequence[list[int]],
        streams: torch.Tensor,
    ) -> None:
        """MTP rows starts[b]... from trunk streams (one row per token of nexts[b]); then chain the drafts."""
        views = [dataclasses.replace(s, num_cached=start) for s, start in zip(seqs, starts, strict=True)]
        logits, mtp_streams = self.runner.draft(views, nexts, streams)
        ends = torch.tensor([len(n) for n in nexts]).cumsum(0).to(logits.device) - 1
        tokens = logits[ends].argmax(dim=-1).tolist()
        state = mtp_streams[ends]
        for s, start, n, t in zip(seqs, starts, nexts, tokens, strict=True):
            self.drafts[s.slot] = _Drafts(start + len(n), [t])
        for step in range(1, self.num_draft):
            live = [b for b, s in enumerate(seqs) if self._room(s, step)]
            if not live:
                break
            views = [
                dataclasses.replace(seqs[b], num_cached=self.drafts[seqs[b].slot].mtp_cached + step - 1)
                for b in live
            ]
            last = [[self.drafts[seqs[b].slot].tokens[-1]] for b in live]
            logits, out = self.runner.draft(views, last, state[live])
            for i, b in enumerate(live):
                self.drafts[seqs[b].slot].tokens.append(int(logits[i].argmax()))
            state = state.clone()
            state[live] = out

    def _room(self, seq: SequenceState, step: int) -> bool:
        """A chained draft row at mtp_cached + step − 1 and its verification must fit in the context."""
        d = self.drafts[seq.slot]
        return d.mtp_cached + step + 2 <= self.runner.max_context and len(d.tokens) == step
