"""Decode steps launched one ahead of the host (what vLLM calls async scheduling, in small).

A recorded decode pass is one launch, but between two passes the host used to wait for the sampled tokens,
read them, decide, and build the next batch, while the GPU idled (~0.24 ms a step on the H200: ~3.5 % of an
all-resident flashnext step). Here pass n+1 is launched before pass n's tokens reach the host: its input ids
are read on the device from what pass n sampled (each lane's newest token is kept at its state slot), and
the host reads pass n's tokens, and builds pass n+2's batch, while pass n+1 runs.

The price is a step of lag in what the host knows. A request that pass n finishes (an end-of-sequence
token) may already be in pass n+1: that pass's token for it is dropped, and its state must stay allocated
until pass n+1 has landed (`uses`). What is known on the host before a launch (max_tokens, the context's
end) never launches a pass for nothing.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from common.engine.runner import ModelRunner
from common.ipc.hostmem import host_list_to
from common.kernels.config import KERNELS
from common.kv.state import SequenceState
from common.protocol import MAX_TOP_LOGPROBS
from common.sampling.sampler import logprobs_of

log = logging.getLogger(__name__)

Pick = Callable[[torch.Tensor], torch.Tensor]
"""logits [B, V] → the lanes' next tokens [B] int64, on the device (sampling, or the argmax)."""


@dataclass
class Launched:
    """A decode pass on its way: its lanes (the caller's objects, in batch order), their states, and the
    tokens it samples, copied to the host behind it."""

    lanes: list
    states: list[SequenceState]
    tokens: torch.Tensor
    """[max_running] int64, pinned on CUDA: the first len(lanes) are the pass's tokens once `done` is."""
    done: torch.cuda.Event | None
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """With `launch`'s `top`: the lanes' `logprobs_of` rows ([B], [B, top], [B, top]) in host buffers."""


class Landed(NamedTuple):
    """A landed pass: its lanes, their tokens, and their `logprobs_of` rows when the launch asked for them."""

    lanes: list
    tokens: list[int]
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None


class DecodePipeline:
    """Launches decode passes over a runner's lanes, at most two at once, and lands them in order.

    Contract: `seed` a lane's token from the host before its first pass (a prompt's first token); every
    pass after reads the token the one before sampled, on the device. `land` the oldest pass before a
    third launch. Nothing a launched pass reads or writes (its states' pages and slots, the expert cache's
    slots it resolved) may be freed or handed to another process before it has landed.
    """

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.depth = getattr(runner.module, "kernels", KERNELS).pipeline_depth  # (configure_kernels)
        """Passes launched and not landed at most: the one running, and the next one queued behind it (1:
        each pass lands before the next is built, the host and the device taking turns)."""
        assert self.depth in (1, 2), "a pass in flight, or one more queued behind it"
        device, lanes = runner.device, runner.pool.max_seqs
        self.newest = torch.zeros(lanes, dtype=torch.int64, device=device)  # [slots] each lane's last token
        cuda = device.type == "cuda"
        # a pinned buffer and an event for each pass that may be launched at once, reused turn by turn
        self._buffers = [torch.zeros(lanes, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self._events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self._logprob_buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        """Per turn, pinned and flat: room for [max_running, 1 + MAX_TOP_LOGPROBS] float32 (chosen, then the
        top) and [max_running, MAX_TOP_LOGPROBS] int64, made at the first pass that asks for logprobs."""
        self._turn = 0
        self.launched: deque[Launched] = deque()

    def seed(self, states: Sequence[SequenceState], tokens: Sequence[int]) -> None:
        """The host-known newest token of each state's lane (its next pass reads it)."""
        device = self.newest.device
        self.newest[host_list_to([s.slot for s in states], device)] = host_list_to(list(tokens), device)

    def launch(
        self, lanes: list, states: Sequence[SequenceState], pick: Pick, top: int | None = None
    ) -> None:
        """A decode pass of one token for each state, its lane's newest, and `pick`'s choice of the next;
        with `top` (0..MAX_TOP_LOGPROBS), the chosen tokens' log-probabilities and the `top` best."""
        assert len(self.launched) < self.depth, "land the oldest pass first"
        logits, slots = self.runner.decode(states, self.newest)  # [B, V], [B]
        tokens = pick(logits)  # [B]
        self.newest[slots] = tokens
        turn, b = self._turn, len(states)
        host, done = self._buffers[turn], self._events[turn]
        self._turn = (turn + 1) % len(self._buffers)
        host[:b].copy_(tokens, non_blocking=True)
        logprobs = None if top is None else self._copy_logprobs(turn, logprobs_of(logits, tokens, top))
        if done is not None:
            done.record()
        self.launched.append(Launched(list(lanes), list(states), host, done, logprobs))

    def _copy_logprobs(
        self, turn: int, rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`rows` copied behind the pass into turn `turn`'s host buffers; views of those buffers. Each copy's
        destination is a contiguous block of pinned memory: a strided one would go through a pageable
        temporary, a copy the host waits for."""
        if not self._logprob_buffers:
            lanes, pin = self.newest.shape[0], self.newest.device.type == "cuda"
            self._logprob_buffers = [
                (
                    torch.zeros(lanes * (1 + MAX_TOP_LOGPROBS), dtype=torch.float32, pin_memory=pin),
                    torch.zeros(lanes * MAX_TOP_LOGPROBS, dtype=torch.int64, pin_memory=pin),
                )
                for _ in self._buffers
            ]
        chosen, values, ids = rows  # [B], [B, top], [B, top]
        b, top = values.shape
        floats, longs = self._logprob_buffers[turn]
        host_values = floats[: b * (1 + top)].view(b, 1 + top)  # chosen, then the top
        host_values.copy_(torch.cat([chosen[:, None], values], dim=1), non_blocking=True)
        host_ids = longs[: b * top].view(b, top)
        host_ids.copy_(ids.contiguous(), non_blocking=True)
        return host_values[:, 0], host_values[:, 1:], host_ids

    def land(self) -> Landed | None:
        """The oldest launched pass's lanes, tokens and log-probabilities (waiting for it), or None when none
        is launched."""
        if not self.launched:
            return None
        oldest = self.launched.popleft()
        if oldest.done is not None:
            oldest.done.synchronize()
        return Landed(oldest.lanes, oldest.tokens[: len(oldest.lanes)].tolist(), oldest.logprobs)

    def ahead(self, lane: object) -> bool:
        """Whether `lane` is in a launched pass that has not landed (its newest token is on the device)."""
        return any(any(x is lane for x in p.lanes) for p in self.launched)

    def uses(self, state: SequenceState) -> bool:
        """Whether a launched pass that has not landed reads or writes `state`."""
        return any(any(s is state for s in p.states) for p in self.launched)

    def abandon(self) -> None:
        """Forget the launched passes without reading their tokens (after a failed step), once the device has
        finished them: what they write must be written before their states can be freed. A failure of that
        wait is the device's own (a sticky error): it is logged, and the passes are forgotten anyway."""
        try:
            while self.launched:
                done = self.launched.popleft().done
                if done is not None:
                    done.synchronize()
        except Exception:
            log.exception("waiting for the abandoned decode passes failed")
        self.launched.clear()
