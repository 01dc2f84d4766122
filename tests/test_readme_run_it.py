"""The README's "Run it", followed in a new virtualenv: the package installs from this checkout (its
dependencies those of this machine, which has no package index to reach), every dependency it declares is
there, `spillway serve` starts from the virtualenv's own script, and the OpenAI features the README lists
answer through the openai client: a `response_format` answer and a forced call cut by `max_tokens`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import venv
from pathlib import Path

import openai
import pytest

from common.model.defaults import default_model_dir
from tests.conftest import free_port, health

ROOT = Path(__file__).resolve().parents[1]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
DECLARED = """
import importlib.metadata as m, json
from packaging.requirements import Requirement
missing = []
for text in m.requires("spillway") or []:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # an extra's
    try:
        version = m.version(req.name)
    except m.PackageNotFoundError:
        missing.append(text)
        continue
    if not req.specifier.contains(version, prereleases=True):
        missing.append(f"{text} (found {version})")
print(json.dumps(missing))
"""


@pytest.mark.slow
def test_run_it_in_a_new_virtualenv(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    install = [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run([*install, "-e", str(ROOT)], check=True, cwd=tmp_path, timeout=300)
    declared = subprocess.run([str(python), "-c", DECLARED], capture_output=True, text=True, check=True)
    assert json.loads(declared.stdout) == [], "declared dependencies missing here"

    port = free_port()
    server = subprocess.Popen(
        [str(env_dir / "bin" / "spillway"), "serve", "--port", str(port)],
        cwd=tmp_path, start_new_session=True, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PATH": f"{env_dir / 'bin'}:{os.environ['PATH']}"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while health(port)[0] != 200:
            assert server.poll() is None and time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        _ask(openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0))
    finally:
        os.killpg(server.pid, signal.SIGINT)  # Ctrl-C: a clean stop logs no error
        _, log = server.communicate(timeout=60)
    assert server.returncode == 0 and " ERROR " not in log, log[-3000:]
    assert " router INFO POST /v1/chat/completions 200 " in log  # the access lines


def _ask(client: openai.OpenAI) -> None:
    model = default_model_dir().name
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "JSON, please"}], max_tokens=64, temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    )  # fmt: skip
    assert isinstance(json.loads(answer.choices[0].message.content)["a"], int)
    cut = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, tool_choice="required",
        max_tokens=40, temperature=0.0,
    )  # fmt: skip
    choice = cut.choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith("{")
