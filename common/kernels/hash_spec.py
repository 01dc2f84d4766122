"""What the n-gram hashing reads of a PLE layer's spec, and its values as device tensors: Triton-free, so the
model's torch hashing (common/model/ngram.py) and the kernel (ngram.py) share one cache."""

from __future__ import annotations

import functools
from typing import Protocol

import torch


class HashSpec(Protocol):
    """What the kernel reads of one PLE layer's n-gram hash (common/model/ngram.py's NGramSpec): the
    longest n-gram, hash heads per order and in all, the token that cuts an n-gram, the multiplier of each
    position (current token first), each head's prime vocabulary and first table row."""

    @property
    def ngram_size(self) -> int: ...
    @property
    def heads_per_ngram(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def eos_token_id(self) -> int: ...
    @property
    def multipliers(self) -> tuple[int, ...]: ...
    @property
    def head_vocab_sizes(self) -> tuple[int, ...]: ...
    @property
    def head_offsets(self) -> tuple[int, ...]: ...


def spec_tensors(spec: HashSpec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The spec's multipliers, head vocabulary sizes and offsets (int64) on `device`, made once: a decode
    step that a CUDA graph records may not copy host values to the device."""
    return _tensors((spec.multipliers, spec.head_vocab_sizes, spec.head_offsets), device)


@functools.cache
def _tensors(
    values: tuple[tuple[int, ...], ...], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mult, sizes, offsets = (torch.tensor(v, dtype=torch.int64, device=device) for v in values)
    return mult, sizes, offsets
