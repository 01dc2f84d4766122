"""Sampling on device tensors: greedy, temperature, top-k, top-p, min-p, reproducible per-request seeds;
the log-probabilities a request may ask for beside its tokens. What a request's penalties, biases and
min_tokens do to its logits before this is common/sampling/logit_processors.py's.

Randomness is counter-based: the noise for (seed, step, token id) is a hash, not a generator's state, so a
request's samples depend only on its own seed and step — never on which other requests share the batch —
and the whole batch samples in one set of tensor ops with no host round trip.
"""

from __future__ import annotations

import torch


def _i64(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _M1, _M2, _STEP = (
    _i64(0x9E3779B97F4A7C15),
    _i64(0xBF58476D1CE4E5B9),
    _i64(0x94D049BB133111EB),
    _i64(0x632BE59BD9B4E019),
)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser on int64 tensors (wrapping arithmetic)."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] uniforms in (0, 1), a pure function of (seed, step, token id)."""
    base = splitmix64(seeds + steps * _STEP)  # [B]
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = _shr(splitmix64(base[:, None] + ids[None, :]), 40)  # top 24 bits
    return (bits.float() + 0.5) * (1.0 / (1 << 24))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next token [B] from logits [B, V]; per row: temperature, top_p (fp32), top_k, seed, step (int64), and
    min_p (fp32) when any row has one."""
    greedy = temperature <= 0
    vocab = logits.shape[-1]
    scaled = logits.float() / torch.where(greedy, 1.0, temperature)[:, None]
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)  # [B, V]
    rank = torch.arange(vocab, device=logits.device)
    keep_k = torch.where(top_k > 0, top_k, vocab)
    sorted_logits = sorted_logits.masked_fill(rank[None, :] >= keep_k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the better-ranked tokens
    # The top token stays, at any top_p (its `before` is exactly 0; a [B] clamp, not a [B, V] mask).
    drop = before >= top_p.clamp_min(1e-12)[:, None]
    if min_p is not None:  # against the best token's probability (column 0): the top token stays too
        drop |= probs < (min_p * probs[:, 0])[:, None]
    probs = probs.masked_fill(drop, 0.0)
    noise = uniform_noise(seeds, steps, vocab).gather(1, sorted_ids)  # keyed by token id, not rank
    # Exponential race: argmax p / Exp(1) draws from p (the Gumbel-max trick in another form).
    choice = torch.argmax(probs / -torch.log(noise), dim=-1, keepdim=True)
    sampled = sorted_ids.gather(1, choice).squeeze(1)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)


def logprobs_of(
    logits: torch.Tensor, tokens: torch.Tensor, top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's log-probabilities of each row's chosen token [B], and the `top` most likely tokens' values
    [B, top] and ids [B, top], best first, from logits [B, V] and tokens [B]. They are the model's own
    distribution, before temperature, top-k and top-p (what OpenAI reports, and vLLM by default): a greedy
    and a sampled request read the same numbers."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
    chosen = logp.gather(1, tokens.view(-1, 1)).squeeze(1)  # [B]
    values, ids = logp.topk(top, dim=-1)  # [B, top]
    return chosen, values, ids
