"""How long a worker's loop is held by structured output's grammars (common/sampling/structured.py) for a
vocabulary of
flashnext's size: the table built at the worker's start, then a new schema's compile, each on the grammars'
thread while the loop (a stand-in that only counts its turns) goes on. The loop's longest gap is what a
decode step could wait. (Before, both ran in the loop: the first structured request held it for the table and
its compile, each new schema for its compile.)

    python -m bench.grammar_stall [--vocab 248320] [--out DIR]   # CPU only: bench/results/grammar-stall.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from concurrent.futures import Future
from pathlib import Path

from bench.common import write_result
from common.sampling.structured import Grammars, structure_of


class RandomVocab:
    """A tokenizer's `token_bytes` over random byte strings (1 to 8 bytes), as many as a real vocabulary."""

    def __init__(self, size: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.vocab_size = size
        self._tokens = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9))) for _ in range(size)]

    def token_bytes(self, token: int) -> bytes:
        return self._tokens[token]


def loop_while(future: Future) -> tuple[float, float]:
    """Turn a loop (each turn ~20 µs of Python) until `future` is done: (seconds waited, longest gap ms)."""
    start = last = time.perf_counter()
    longest = 0.0
    while not future.done():
        sum(range(500))
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    return last - start, longest * 1e3


def schema(fields: int) -> str:
    """A json_schema form of `fields` required properties, each a list of one of 20 strings."""
    item = {"type": "array", "items": {"enum": [f"v{j}" for j in range(20)]}}
    body = {"type": "object", "properties": {f"k{i}": item for i in range(fields)}}
    body["required"] = list(body["properties"])
    return structure_of({"type": "json_schema", "json_schema": {"schema": body}})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=248320, help="tokens (flashnext's: 248,320)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    vocab = RandomVocab(args.vocab)
    began = time.perf_counter()
    import xgrammar  # noqa: F401  (once a process, at a worker's start: apart from the loop's gaps)

    import_ms = (time.perf_counter() - began) * 1e3
    began = time.perf_counter()
    grammars = Grammars(vocab, args.vocab, [0])  # type: ignore[arg-type]  (a tokenizer's token_bytes)
    started_ms = (time.perf_counter() - began) * 1e3
    table_s, table_gap = loop_while(grammars._compiler)
    result: dict = {
        "vocab": args.vocab,
        "import_ms": import_ms,
        "start_call_ms": started_ms,
        "table_s": table_s,
        "table_longest_gap_ms": table_gap,
        "compiles": [],
    }
    for fields in (1, 10, 40):
        form = schema(fields)
        began = time.perf_counter()
        future = grammars.prepare(form)
        call_ms = (time.perf_counter() - began) * 1e3
        compile_s, gap = loop_while(future)
        result["compiles"].append(
            {"fields": fields, "prepare_call_ms": call_ms, "compile_s": compile_s, "longest_gap_ms": gap}
        )
    print(json.dumps(result, indent=1))
    print(write_result("grammar-stall", result, args.out))


if __name__ == "__main__":
    main()
