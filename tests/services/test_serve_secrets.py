"""The API key end to end: `spillway serve --api-key-file` on the tiny model. No process's command line (as
`ps` reads it: /proc/<pid>/cmdline) holds the key; `/v1`, `/metrics` and every worker's metrics port refuse
a request without it; `/health` without it says only its status."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from common.ipc.ports import free_ports
from tests.conftest import health

pytestmark = pytest.mark.slow

KEY = "sk-spillway-test-4f1c9e"


def _descendants(pid: int) -> list[int]:
    """Every process under `pid` (its children, theirs, ...), read from /proc."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def _status(url: str, key: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def test_the_key_is_on_no_command_line_and_guards_every_port(start_server, tmp_path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    metrics = free_ports(3)
    server = start_server(
        "--threads", "1", "--api-key-file", str(key_file), "--metrics-port", str(metrics),
        env={"SPILLWAY_CACHE": str(tmp_path)},
    )  # fmt: skip
    processes = [server.proc.pid, *_descendants(server.proc.pid)]
    assert len(processes) >= 4  # the launcher, router, prefill, decode
    for pid in processes:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert KEY.encode() not in argv, argv.replace(b"\0", b" ")
    assert health(server.port) == (200, {"status": "ok"})
    url = f"http://127.0.0.1:{server.port}"
    assert {"services", "pairs"} <= health_with_key(url).keys()
    for port in (server.port, metrics, metrics + 1, metrics + 2):  # the router's /metrics, then each port's
        assert _status(f"http://127.0.0.1:{port}/metrics") == 401
        assert _status(f"http://127.0.0.1:{port}/metrics", "wrong") == 401
        assert _status(f"http://127.0.0.1:{port}/metrics", KEY) == 200
    with pytest.raises(openai.AuthenticationError):
        server.client().models.list()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    out = client.completions.create(model="tiny-qwen3_moe", prompt="hi", max_tokens=2)
    assert out.usage.completion_tokens == 2


def health_with_key(url: str) -> dict:
    request = urllib.request.Request(f"{url}/health", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=5) as resp:
        return json.loads(resp.read())
