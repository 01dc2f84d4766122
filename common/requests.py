"""A request being generated, and the per-step helpers every generation loop shares (offline engine,
decode and prefill workers): sampling a batch of requests on device and deciding when one is finished."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from common.hostmem import host_list_to
from common.kv.state import SequenceState
from common.sampling import SamplingParams, sample


@dataclass
class Request:
    """One prompt being generated."""

    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    state: SequenceState
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    rid: str = ""
    """The router's id (serving); empty offline."""


def sample_next(logits: torch.Tensor, reqs: Sequence[Request]) -> list[int]:
    """Each request's next token from its row of logits [B, V] (its sampling step = tokens so far)."""
    device = logits.device

    def t(values: list, dtype: torch.dtype) -> torch.Tensor:
        return host_list_to(values, device, dtype)

    return sample(
        logits,
        t([r.params.temperature for r in reqs], torch.float32),
        t([r.params.top_p for r in reqs], torch.float32),
        t([r.params.top_k for r in reqs], torch.int64),
        t([r.seed for r in reqs], torch.int64),
        t([len(r.token_ids) for r in reqs], torch.int64),
    ).tolist()


def append_token(req: Request, token: int, eos_ids: Sequence[int], max_context: int) -> bool:
    """Append `token` and set `finish_reason` when it ends the request: `stop` (an end-of-sequence or stop
    token) or `length` (max_tokens, or the context is full). True when the request is finished."""
    req.token_ids.append(token)
    p = req.params
    if token in p.stop_token_ids or (not p.ignore_eos and token in eos_ids):
        req.finish_reason = "stop"
    elif len(req.token_ids) >= p.max_tokens or req.state.num_cached + 1 >= max_context:
        req.finish_reason = "length"
    return req.finish_reason is not None
