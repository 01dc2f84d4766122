"""A request being generated, and the per-step helpers every generation loop shares (offline engine,
decode and prefill workers): sampling a batch of requests on device and deciding when one is finished."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.ipc.hostmem import host_list_to
from common.protocol import TokenLogprobs
from common.sampling.logit_processors import LogitProcessors
from common.sampling.request import Request as Request  # re-exported: callers take it from here
from common.sampling.sampler import logprobs_of, sample


def sample_next(logits: torch.Tensor, reqs: Sequence[Request], processors: LogitProcessors) -> list[int]:
    """Each request's next token from its row of logits [B, V] (its sampling step = tokens so far), read
    to the host (and by the requests' grammars)."""
    return sample_with_logprobs(logits, reqs, processors)[0]


def sample_with_logprobs(
    logits: torch.Tensor, reqs: Sequence[Request], processors: LogitProcessors
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """`sample_next`, and each request's log-probabilities of its token when it asked for them."""
    tokens = sample_on_device(logits, reqs, processors)
    top = top_logprobs(reqs)
    asked = [r.params.logprobs for r in reqs]
    rows: list[TokenLogprobs | None]
    rows = [None] * len(reqs) if top is None else host_logprobs(*logprobs_of(logits, tokens, top), asked)
    listed = tokens.tolist()
    for req, token in zip(reqs, listed, strict=True):
        processors.accept(req, token)
    return listed, rows


def top_logprobs(reqs: Sequence[Request]) -> int | None:
    """The most alternatives any of `reqs` asks log-probabilities of; None when none asks for any."""
    asks = [r.params.logprobs for r in reqs if r.params.logprobs is not None]
    return max(asks) if asks else None


def host_logprobs(
    chosen: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, asked: Sequence[int | None]
) -> list[TokenLogprobs | None]:
    """Each row's `TokenLogprobs` from a batch's `logprobs_of` rows ([B], [B, top], [B, top]; read to the
    host here), with `asked[b]` alternatives (a request's own number), None where it is None."""
    chosen_, values_, ids_ = chosen.tolist(), values.tolist(), ids.tolist()
    rows: list[TokenLogprobs | None] = []
    for b, k in enumerate(asked):
        rows.append(None if k is None else TokenLogprobs(chosen_[b], ids_[b][:k], values_[b][:k]))
    return rows


def sample_on_device(
    logits: torch.Tensor, reqs: Sequence[Request], processors: LogitProcessors, ahead: Sequence[int] = ()
) -> torch.Tensor:
    """Each request's next token [B] from its row of logits [B, V] as `processors` leave it, left on the
    device (and counted there for the penalties). Its sampling step is the tokens it has so far, `ahead[b]`
    of them sampled but not yet on the host (a pipelined decode's). A batch of greedy requests only takes
    the argmax (what `sample` gives them, without its sort)."""
    ahead = ahead or [0] * len(reqs)
    logits = processors.apply(logits, reqs, ahead)
    if all(r.params.temperature <= 0 for r in reqs):
        tokens = logits.argmax(dim=-1)
    else:
        tokens = _sample(logits, reqs, ahead)
    processors.count(reqs, tokens)
    return tokens


def _sample(logits: torch.Tensor, reqs: Sequence[Request], ahead: Sequence[int]) -> torch.Tensor:
    device = logits.device

    def t(values: list, dtype: torch.dtype) -> torch.Tensor:
        return host_list_to(values, device, dtype)

    min_p = [r.params.min_p for r in reqs]
    return sample(
        logits,
        t([r.params.temperature for r in reqs], torch.float32),
        t([r.params.top_p for r in reqs], torch.float32),
        t([r.params.top_k for r in reqs], torch.int64),
        t([r.seed for r in reqs], torch.int64),
        t([len(r.token_ids) + a for r, a in zip(reqs, ahead, strict=True)], torch.int64),
        t(min_p, torch.float32) if any(min_p) else None,
    )


def append_token(req: Request, token: int, eos_ids: Sequence[int], max_context: int, ahead: int = 0) -> bool:
    """Append `token` and set `finish_reason` when it ends the request: `stop` (an end-of-sequence or stop
    token) or `length` (max_tokens, or the context is full). True when the request is finished. `ahead`:
    passes its state has taken past this token's (a pipelined decode's step in flight)."""
    req.token_ids.append(token)
    p = req.params
    if token in p.stop_token_ids or (not p.ignore_eos and token in eos_ids):
        req.finish_reason = "stop"
    elif ends_by_length(req, max_context, len(req.token_ids), req.state.num_cached - ahead):
        req.finish_reason = "length"
    return req.finish_reason is not None


def ends_by_length(req: Request, max_context: int, tokens: int, cached: int) -> bool:
    """Whether `req`'s token number `tokens` is its last by length (max_tokens, or the context full), its
    state holding `cached` tokens when that token is sampled."""
    return tokens >= req.params.max_tokens or cached + 1 >= max_context
