"""What one huge prompt does to a served stack (issue 56's probe): `spillway serve` on the tiny model (CPU), 4
streams running, then a chat and a text completion of `--mb` MB each (`--enum N`: instead, a chat whose
`response_format` is a JSON schema of an N-string enum, its grammar compiled apart from the loops). Reports
the slowest `/health` (polled every 10 ms throughout), the longest wait between two events of any stream, the
router's peak RSS (VmHWM) and what the huge requests got (curl sends them: a process apart from the one that
times `/health`).

    python -m bench.prompt_stall [--mb 45 | --enum 400000 [--grammar-max-bytes 8MiB]] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.common import write_result
from bench.served import served

STREAM = {"model": "tiny-qwen3_moe", "prompt": "go", "max_tokens": 300, "ignore_eos": True, "stream": True}


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _stream(url: str, gaps: list[float]) -> None:
    longest, last = 0.0, None
    with httpx.stream("POST", f"{url}/v1/completions", json=STREAM, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                now = time.monotonic()
                longest, last = max(longest, now - (last or now)), now
    gaps.append(longest)


def _huge(url: str, path: str, body: Path, answers: list) -> None:
    """POST the file `body` to `path` with curl (a process of its own: this one's GIL times `/health`)."""
    started = time.monotonic()
    argv = ["curl", "-s", "-H", "content-type: application/json", "--data-binary", f"@{body}", f"{url}{path}"]
    out = subprocess.run(argv, capture_output=True, check=True).stdout
    answers.append({"path": path, "seconds": time.monotonic() - started,
                    "error": json.loads(out).get("error", {}).get("code")})  # fmt: skip


def huge_bodies(mb: float, enum: int) -> dict[str, dict]:
    """The requests sent beside the streams, by path: two prompts of `mb` MB, or a chat with an `enum`-string
    schema."""
    if enum:
        schema = {"type": "string", "enum": [f"item-{i}" for i in range(enum)]}
        response_format = {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}
        chat = {
            "model": "tiny-qwen3_moe",
            "messages": [{"role": "user", "content": "pick one"}],
            "max_tokens": 8,
        }
        return {"/v1/chat/completions": {**chat, "response_format": response_format}}
    text = "hello world, café " * int(mb * 1e6 / 19)
    return {
        "/v1/chat/completions": {"model": "tiny-qwen3_moe", "messages": [{"role": "user", "content": text}]},
        "/v1/completions": {"model": "tiny-qwen3_moe", "prompt": text},
    }


def probe(url: str, router: int, mb: float, enum: int = 0) -> dict:
    bodies = huge_bodies(mb, enum)
    gaps: list[float] = []
    answers: list[dict] = []
    streams = [threading.Thread(target=_stream, args=(url, gaps)) for _ in range(4)]
    files = {p: Path(tempfile.mkstemp(suffix=".json")[1]) for p in bodies}
    for path, body in bodies.items():
        files[path].write_text(json.dumps(body, ensure_ascii=False))
    huge = [threading.Thread(target=_huge, args=(url, p, f, answers)) for p, f in files.items()]
    for thread in streams:
        thread.start()
    time.sleep(1.0)
    for thread in huge:
        thread.start()
    slowest, polls, rss = 0.0, 0, 0
    with httpx.Client(timeout=60) as client:
        while any(t.is_alive() for t in streams + huge):
            began = time.monotonic()
            client.get(f"{url}/health")
            slowest, polls = max(slowest, time.monotonic() - began), polls + 1
            rss = max(rss, _status_kb(router, "VmRSS"))
            time.sleep(0.01)
    for file in files.values():
        file.unlink()
    return {
        "prompt_mb": 0 if enum else mb,
        "enum_items": enum,
        "health_polls": polls,
        "health_slowest_ms": slowest * 1e3,
        "stream_longest_gap_ms": max(gaps) * 1e3,
        "router_rss_peak_mb": max(rss, _status_kb(router, "VmHWM")) / 1024,
        "huge_requests": answers,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=45.0, help="each huge prompt's size in MB")
    ap.add_argument("--enum", type=int, default=0, help="instead: a schema of this many enum strings")
    ap.add_argument(
        "--grammar-max-bytes", default=None, help="serve's schema size budget (8MiB: the enum compiles)"
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    flags = [] if args.grammar_max_bytes is None else ["--grammar-max-bytes", args.grammar_max_bytes]
    with served(flags) as (url, router):
        result = {**probe(url, router, args.mb, args.enum), "serve_flags": flags}
    print(json.dumps(result, indent=1))
    name = "prompt-stall" + ("-enum" if args.enum else "") + ("-compiled" if flags else "")
    print(write_result(name, result, args.out))


if __name__ == "__main__":
    main()
