"""The embedded default model: the `tiny` synthetic checkpoint, created once in a cache directory."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_ARCH = "qwen3_moe"


def cache_dir() -> Path:
    """$SPILLWAY_CACHE, else $XDG_CACHE_HOME/spillway, else ~/.cache/spillway."""
    if env := os.environ.get("SPILLWAY_CACHE"):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spillway"


def default_model_dir() -> Path:
    """The tiny model's directory, written on first use (atomically: a crash leaves no half model)."""
    target = cache_dir() / "models" / f"tiny-{DEFAULT_ARCH}"
    if (target / "config.json").is_file():
        return target
    from common.model.synthetic import make_model

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    try:
        make_model(staging, preset="tiny", arch=DEFAULT_ARCH)
        staging.rename(target)
    except OSError:
        if not (target / "config.json").is_file():  # lost a race to another process: theirs is complete
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
