"""End-to-end check of the compose deployment, for a machine with Docker (or podman behind its Docker API):

    python deploy/smoke.py [--gpu] [--no-build] [--keep]

Starts the stack, asks for a greedy chat completion, checks that Prometheus scrapes all three services (and
says whether the vision encoder's target is up: down for a text-only model, whose encoder exits at start),
kills decode's process (a crash, not a stop: the restart policy applies), checks that the stream in flight
ends with an error at once and that the restarted stack gives the same completion, then takes the stack
down (`--keep`: leaves it up; `--gpu`: with docker-compose.gpu.yml). `COMPOSE="docker-compose"` picks
another compose command. Stdlib only.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

DEPLOY = Path(__file__).resolve().parent
API = "http://127.0.0.1:8000"
CHAT = {
    "messages": [{"role": "user", "content": "Tell me about experts."}],
    "max_tokens": 16,
    "temperature": 0,
}
# (this script's own command line names the module too: it must not kill itself first)
KILL_DECODE = (
    "import os, signal\n"
    "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
    "    cmd = open(f'/proc/{pid}/cmdline', 'rb').read().split(b'\\0')\n"
    "    if b'services.decode' in cmd and int(pid) != os.getpid():\n"
    "        os.kill(int(pid), signal.SIGKILL)\n"
)


FILES = ["docker-compose.yml"]


def compose(*args: str, check: bool = True) -> int:
    command = shlex.split(os.environ.get("COMPOSE", "docker compose"))
    for name in FILES:
        command += ["-f", f"{DEPLOY}/{name}"]
    return subprocess.run([*command, *args], check=check).returncode


def get(url: str, body: dict | None = None, timeout: float = 60) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
    except OSError:
        return 0, {}


def wait(what: str, check, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            sys.exit(f"FAILED: {what} (after {timeout_s:.0f} s)")
        time.sleep(1)
    print(f"ok: {what}")


def chat() -> str:
    status, body = get(f"{API}/v1/chat/completions", CHAT)
    if status != 200:
        sys.exit(f"FAILED: chat completion: {status} {body}")
    return body["choices"][0]["message"]["content"]


def stream_until_error(result: dict) -> None:
    """A long stream; records how long after the kill it ended, and its last event."""
    body = {**CHAT, "max_tokens": 4000, "ignore_eos": True, "stream": True, "temperature": 0.8}
    request = urllib.request.Request(f"{API}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    last = ""
    with urllib.request.urlopen(request, timeout=300) as resp:
        for line in resp:
            if line.startswith(b"data: {"):
                last = line.decode()
    result.update(ended=time.monotonic(), last=last)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-build", action="store_true", help="use the spillway:latest image as it is")
    parser.add_argument("--keep", action="store_true", help="leave the stack up")
    parser.add_argument("--gpu", action="store_true", help="the workers on a GPU (docker-compose.gpu.yml)")
    args = parser.parse_args()
    if args.gpu:
        FILES.append("docker-compose.gpu.yml")
    compose("up", "-d", *(["--no-build"] if args.no_build else ["--build"]))
    try:
        wait("/health is 200", lambda: get(f"{API}/health")[0] == 200)
        first = chat()
        print(f"ok: greedy completion {first!r}")
        targets = "http://127.0.0.1:9090/api/v1/targets"
        up = lambda: {t["labels"]["job"] for t in get(targets)[1].get("data", {}).get("activeTargets", [])
                      if t["health"] == "up"}  # fmt: skip
        wait(
            "Prometheus scrapes router, prefill and decode",
            lambda: {"router", "prefill", "decode"} <= up(),
            60,
        )
        print(f"ok: the encoder's target is {'up' if 'encoder' in up() else 'down (a text-only model?)'}")
        result: dict = {}
        streaming = threading.Thread(target=stream_until_error, args=(result,))
        streaming.start()
        time.sleep(2)
        killed = time.monotonic()
        compose("exec", "-T", "decode", "python", "-c", KILL_DECODE)
        streaming.join(timeout=200)
        if "error" not in result.get("last", ""):
            sys.exit(f"FAILED: the stream in flight did not end with an error: {result}")
        print(f"ok: the stream in flight ended with an error {result['ended'] - killed:.1f} s after the kill")
        wait("/health is 200 again", lambda: get(f"{API}/health")[0] == 200)
        again = chat()
        if again != first:
            sys.exit(f"FAILED: after the restart {again!r} != {first!r}")
        print("ok: the restarted stack gives the same completion")
    finally:
        if not args.keep and compose("down", check=False):  # again if containers were still restarting
            compose("down")


if __name__ == "__main__":
    main()
