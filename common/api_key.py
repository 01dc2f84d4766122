"""The API key: where a process finds it (a file or the environment, never its command line, which `ps`
shows every local user) and how a request proves it has it (`Authorization: Bearer <key>`)."""

from __future__ import annotations

import hmac
import os
from pathlib import Path

API_KEY_ENV = "SPILLWAY_API_KEY"
"""The environment variable that holds the key; a launcher hands it to its children this way."""


def resolve_api_key(given: str | None = None, path: str | Path | None = None) -> str | None:
    """The key: `given` (a command line's, where a user passed one), else the first line of the file at
    `path`, else `$SPILLWAY_API_KEY`; None (or empty) for none. ValueError for an unreadable or empty
    file."""
    if given:
        return given
    if path is not None:
        try:
            key = Path(path).read_text().partition("\n")[0].strip()
        except OSError as exc:
            raise ValueError(f"cannot read the API key file {path}: {exc.strerror}") from None
        if not key:
            raise ValueError(f"the API key file {path} is empty")
        return key
    return os.environ.get(API_KEY_ENV) or None


def authorized(header: str | None, key: str | None) -> bool:
    """Whether an `Authorization` header value carries `key` as a Bearer token (any does where `key` is
    None); compared in constant time."""
    if not key:
        return True
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())
