"""Overload on a served stack (issue 56's probe): `spillway serve --max-running 4 --max-queue 8` on the tiny
model (CPU), `--clients` threads each sending non-streamed completions back to back for `--seconds`: every
request must be answered 200 or 429 (never 503 while the workers live) and none lost (no answer at all).

    python -m bench.overload [--clients 50] [--seconds 120] [--words 600] [--tokens 256] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from bench.common import write_result
from bench.served import served


def client(url: str, body: dict, until: float, answers: Counter, lock: threading.Lock) -> None:
    """Send `body` again and again until `until`, counting each answer's status ("lost": none came)."""
    with httpx.Client(timeout=600) as http:
        while time.monotonic() < until:
            try:
                key: int | str = http.post(f"{url}/v1/completions", json=body).status_code
            except httpx.HTTPError:
                key = "lost"
            with lock:
                answers[key] += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--words", type=int, default=600, help="words of each prompt (5 tokens a word: tiny)")
    ap.add_argument("--tokens", type=int, default=256, help="max_tokens of each request (ignore_eos)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    body = {"prompt": "hello " * args.words, "max_tokens": args.tokens, "ignore_eos": True}
    answers: Counter = Counter()
    lock = threading.Lock()
    with served(["--max-running", "4", "--max-queue", "8"]) as (url, _):
        body["model"] = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        started = time.monotonic()
        until = started + args.seconds
        work = (url, body, until, answers, lock)
        threads = [threading.Thread(target=client, args=work) for _ in range(args.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        health = httpx.get(f"{url}/health").json()
    result = {
        "clients": args.clients,
        "seconds": args.seconds,
        "wall_s": time.monotonic() - started,
        "answers": {str(k): v for k, v in sorted(answers.items(), key=str)},
        "other_than_200_429": sum(v for k, v in answers.items() if k not in (200, 429)),
        "health_after": health.get("status"),
    }
    print(json.dumps(result, indent=1))
    print(write_result("overload", result, args.out))


if __name__ == "__main__":
    main()
