"""Errors a user can act on: each names the file and, where there is one, the key."""

from __future__ import annotations

from pathlib import Path


class CheckpointError(ValueError):
    """A model directory that cannot be loaded: missing file, unknown architecture, bad tensor."""

    def __init__(self, message: str, path: str | Path | None = None, key: str | None = None) -> None:
        where = []
        if path is not None:
            where.append(f"file {path}")
        if key is not None:
            where.append(f"key {key!r}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)
        self.path = None if path is None else Path(path)
        self.key = key
