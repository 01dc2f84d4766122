"""Progress bars for long steps (writing and converting checkpoints, building the host store, replaying
traces): tqdm on stderr where stderr is a terminal, nothing otherwise (logs, CI and tests stay clean)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")


def progress(items: Iterable[T], desc: str, total: int | None = None, unit: str = "it") -> Iterator[T]:
    """`items` as they come, with a bar of `total` (default: len(items) where it has one) named `desc`."""
    return iter(tqdm(items, desc=desc, total=total, unit=unit, disable=None, leave=False, dynamic_ncols=True))
