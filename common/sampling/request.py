"""One request being generated: its prompt, sampling parameters, state and tokens so far."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.kv.state import SequenceState
from common.protocol import SamplingParams


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
