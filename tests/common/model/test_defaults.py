"""The embedded default model: written once into the cache, again when the cached one is of an older
revision, and never half-written for a process that comes while another writes it."""

from __future__ import annotations

import concurrent.futures
import json

from common.model import defaults


def test_written_once_and_again_for_an_older_revision(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPILLWAY_CACHE", str(tmp_path))
    first = defaults.default_model_dir()
    assert (first / defaults.REVISION_FILE).read_text() == defaults.REVISION
    stamp = (first / "config.json").stat().st_mtime_ns
    assert defaults.default_model_dir() == first and (first / "config.json").stat().st_mtime_ns == stamp
    (first / defaults.REVISION_FILE).write_text("1")
    (first / "stale").write_text("from the old revision")
    again = defaults.default_model_dir()
    assert again == first and not (again / "stale").exists()
    assert (again / defaults.REVISION_FILE).read_text() == defaults.REVISION
    assert not list(tmp_path.glob("models/.old-*")) and not list(tmp_path.glob("models/.tiny-*"))


def test_callers_at_once_all_get_a_whole_model(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPILLWAY_CACHE", str(tmp_path))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        dirs = list(pool.map(lambda _: defaults.default_model_dir(), range(4)))
    assert len(set(dirs)) == 1 and json.loads((dirs[0] / "config.json").read_text())["model_type"]
