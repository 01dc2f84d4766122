"""Hashed n-gram ids of qwen4_exp's PLE module (the per-layer embedding over bi- and tri-grams).

Each PLE layer hashes, for every token, the bigram and trigram ending at it into `heads_per_ngram` ids per
n-gram order, each in its own prime-sized vocabulary; the ids index one table (all heads stacked, padded to
a multiple of `make_ngram_vocab_size_divisible_by`). The parameters are derived from the config alone
(splitmix64 multipliers, primes after `ngram_vocab_size_base`), exactly as transformers derives them.
Context never crosses an end-of-sequence token: after EOS, the missing history reads as EOS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from common.kernels.hash_spec import spec_tensors

_MASK64 = (1 << 64) - 1
_GAMMA, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_LAYER_PRIME = 10007


def splitmix64_int(value: int) -> int:
    """splitmix64 on a Python int (mod 2**64)."""
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _M1) & _MASK64
    value = ((value ^ (value >> 27)) * _M2) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def _primes_after(start: int, count: int) -> list[int]:
    """The first `count` primes greater than `start`."""
    primes: list[int] = []
    p = start
    while len(primes) < count:
        p += 1
        if _is_prime(p):
            primes.append(p)
    return primes


@dataclass(frozen=True)
class NGramSpec:
    """Hash parameters of one PLE layer's n-gram embedding."""

    ngram_size: int
    """Longest n-gram (3: bigrams and trigrams)."""
    heads_per_ngram: int
    """Hash heads per n-gram order."""
    multipliers: tuple[int, ...]
    """Odd int64 multiplier per position in the n-gram (current token first)."""
    head_vocab_sizes: tuple[int, ...]
    """Prime vocabulary of each head, [(ngram_size - 1) * heads_per_ngram]."""
    head_offsets: tuple[int, ...]
    """First table row of each head."""
    table_rows: int
    """Rows of the table, padded."""
    eos_token_id: int
    """The token that cuts n-gram context."""

    @property
    def num_heads(self) -> int:
        return len(self.head_vocab_sizes)

    @classmethod
    def build(
        cls,
        vocab_size: int,
        ngram_size: int,
        heads_per_ngram: int,
        vocab_size_base: int,
        divisible_by: int,
        seed: int,
        ple_index: int,
        eos_token_id: int,
    ) -> NGramSpec:
        """The parameters of the `ple_index`-th PLE layer (its position in the sorted ple_layer_ids)."""
        half_bound = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
        base_seed = seed + _LAYER_PRIME * ple_index
        multipliers = tuple(
            2 * (splitmix64_int((base_seed + _GAMMA * (i + 1)) & _MASK64) % half_bound) + 1
            for i in range(ngram_size)
        )
        num_heads = (ngram_size - 1) * heads_per_ngram
        all_primes = _primes_after(vocab_size_base - 1, (ple_index + 1) * num_heads)
        sizes = tuple(all_primes[ple_index * num_heads :])
        offsets = tuple(sum(sizes[:i]) for i in range(num_heads))
        rows = math.ceil(sum(sizes) / divisible_by) * divisible_by
        return cls(ngram_size, heads_per_ngram, multipliers, sizes, offsets, rows, eos_token_id)


def ngram_shard_rows(rows: int, parts: int) -> list[int]:
    """Rows of each checkpoint shard of a table of `rows` rows saved in `parts` parts.

    transformers saves the table with torch.chunk: shards of ceil(rows / parts) rows, the last one shorter,
    and fewer than `parts` shards where that many would leave some empty.
    """
    size = math.ceil(rows / parts)
    count = math.ceil(rows / size)
    return [size] * (count - 1) + [rows - size * (count - 1)]


def shifted_history(history: torch.Tensor, shift: int, eos: int) -> torch.Tensor:
    """history [N, S] shifted right by `shift`; where an EOS lies in the last `shift` tokens, EOS."""
    if shift == 0:
        return history
    n, s = history.shape
    pos = torch.arange(s, device=history.device)
    eos_pos = torch.where(history == eos, pos, -1)
    last_eos_before = torch.cat(
        [eos_pos.new_full((n, 1), -1), torch.cummax(eos_pos, dim=1).values[:, :-1]], dim=1
    )
    valid = (pos - (last_eos_before + 1) >= shift) & (pos >= shift)
    shifted = history.gather(1, (pos - shift).clamp_min(0).expand(n, -1))
    return torch.where(valid, shifted, torch.full_like(history, eos))


def ngram_ids(spec: NGramSpec, history: torch.Tensor, num_new: int) -> torch.Tensor:
    """Table rows [N, num_new, heads] of the last `num_new` tokens of history [N, S] (S ≥ num_new + n - 1)."""
    mult, sizes, offsets = spec_tensors(spec, history.device)
    shifted = [shifted_history(history, s, spec.eos_token_id) for s in range(spec.ngram_size)]
    blocks = []
    for order in range(2, spec.ngram_size + 1):
        heads = slice((order - 2) * spec.heads_per_ngram, (order - 1) * spec.heads_per_ngram)
        mixed = shifted[0] * mult[0]
        for position in range(1, order):
            mixed = torch.bitwise_xor(mixed, shifted[position] * mult[position])
        blocks.append(torch.remainder(mixed[..., None], sizes[heads]) + offsets[heads])
    return torch.cat(blocks, dim=-1)[:, -num_new:]
