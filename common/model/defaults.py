"""The embedded default model: the `tiny` synthetic checkpoint, created once in a cache directory."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_ARCH = "qwen3_moe"
REVISION = "2"
"""The embedded model's revision: a cached one of another is written again (2: the chat template lists
tools and reads and writes tool calls)."""
REVISION_FILE = ".spillway-revision"


def cache_dir() -> Path:
    """$SPILLWAY_CACHE, else $XDG_CACHE_HOME/spillway, else ~/.cache/spillway."""
    if env := os.environ.get("SPILLWAY_CACHE"):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spillway"


def default_model_dir() -> Path:
    """The tiny model's directory, written on first use and again when the cached one is of an older
    revision (atomically: a crash leaves no half model)."""
    target = cache_dir() / "models" / f"tiny-{DEFAULT_ARCH}"
    if _current(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".tiny.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one writer at a time: another may be writing it as we came
        return target if _current(target) else _write(target)


def _write(target: Path) -> Path:
    from common.model.synthetic.checkpoint import make_model

    staging = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    try:
        make_model(staging, preset="tiny", arch=DEFAULT_ARCH)
        (staging / REVISION_FILE).write_text(REVISION)
        if target.exists():  # an older revision: moved aside, then removed
            shutil.move(target, Path(tempfile.mkdtemp(prefix=".old-", dir=target.parent)) / "model")
        staging.rename(target)
    except OSError:
        if not _current(target):  # lost a race to another process: theirs is complete
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        for old in target.parent.glob(".old-*"):
            shutil.rmtree(old, ignore_errors=True)
    return target


def _current(model_dir: Path) -> bool:
    """Whether `model_dir` holds a complete default model of this revision."""
    revision = model_dir / REVISION_FILE
    return (model_dir / "config.json").is_file() and revision.is_file() and revision.read_text() == REVISION
