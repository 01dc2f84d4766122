"""Where the API key comes from, and the metrics ports' check of it (a real HTTP server)."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import pytest

from common import metrics
from common.api_key import authorized, resolve_api_key
from common.ipc.ports import free_ports


def test_the_key_is_given_else_read_from_a_file_else_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SPILLWAY_API_KEY", raising=False)
    assert resolve_api_key() is None
    monkeypatch.setenv("SPILLWAY_API_KEY", "env")
    assert resolve_api_key() == "env"
    (tmp_path / "key").write_text("file\nthe second line is not the key\n")
    assert resolve_api_key(path=tmp_path / "key") == "file"
    assert resolve_api_key("given", tmp_path / "key") == "given"
    (tmp_path / "empty").write_text(" \n")
    with pytest.raises(ValueError, match="empty"):
        resolve_api_key(path=tmp_path / "empty")
    with pytest.raises(ValueError, match="cannot read"):
        resolve_api_key(path=tmp_path / "missing")


def test_a_bearer_token_must_carry_the_key() -> None:
    assert authorized(None, None) and authorized("anything", "")
    assert authorized("Bearer k3y", "k3y") and authorized("bearer  k3y ", "k3y")
    for header in (None, "", "k3y", "Basic k3y", "Bearer k3", "Bearer k3yy"):
        assert not authorized(header, "k3y")


def _get(url: str, key: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as resp:
            assert b"spillway:" in resp.read()
            return resp.status
    except urllib.error.HTTPError as err:
        assert err.headers["WWW-Authenticate"] == "Bearer"
        return err.code


def test_a_metrics_port_with_a_key_refuses_requests_without_it() -> None:
    registry = metrics.new_registry()
    metrics.WorkerMetrics.create(registry)
    guarded, open_port = free_ports(2), None
    stops = [metrics.serve(registry, guarded, api_key="k3y")]
    open_port = guarded + 1
    stops.append(metrics.serve(registry, open_port))
    try:
        url = f"http://127.0.0.1:{guarded}/metrics"
        assert (_get(url), _get(url, "nope"), _get(url, "k3y")) == (401, 401, 200)
        assert _get(f"http://127.0.0.1:{open_port}/metrics") == 200
    finally:
        for stop in stops:
            stop()
