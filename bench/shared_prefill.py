"""n choices of one prompt: one prefill with siblings (decode copies the prompt's state to each) against n
requests, each prefilled on its own. Prefill and decode cores in one process, their messages through the
wire encoding (as tests/common/workers/test_cores.py drives them); the time until every choice has its first
token, and until every choice has all of its tokens.

    python -m bench.shared_prefill [--prompt 1000] [--n 4] [--decode 16] [--device cpu] [--out DIR]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.common import write_result
from common.config import WorkerConfig
from common.model.defaults import default_model_dir
from common.protocol import Generate, SamplingParams, Sibling, Tokens, decode, encode
from common.workers.decode import DecodeCore
from common.workers.prefill import Outgoing, PrefillCore
from common.workers.sharing import decode_exports, host_allocator, prefill_model, shared_allocator
from tests.common.workers.pair import deliver


def pump(dec: DecodeCore, pre: PrefillCore, box: Outgoing, rids: list[str]) -> tuple[float, float]:
    """Deliver messages and step both cores until every one of `rids` has finished: (seconds until each
    has its first token, seconds until each has finished)."""
    began, first, finished = time.perf_counter(), set(), set()
    first_at = 0.0

    def seen(event: Tokens) -> None:
        first.add(event.rid)
        finished.update([event.rid] if event.finish_reason else [])

    while len(finished) < len(rids):
        box = deliver(dec, pre, box, seen) + pre.step()
        for event in dec.step():
            seen(event)
            if event.finish_reason:
                box += [("prefill", g) for g in dec.grant_pending()]
        if not first_at and len(first) == len(rids):
            first_at = time.perf_counter() - began
    return first_at, time.perf_counter() - began


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--decode", type=int, default=16, help="tokens each choice generates")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    cfg = WorkerConfig(
        model_dir=str(default_model_dir()), max_running=args.n, max_context=args.prompt + args.decode + 8,
        device=args.device, dtype="float32",
    )  # fmt: skip
    dec = DecodeCore(cfg, shared_allocator, host_allocator)
    model, pools, eos = prefill_model(cfg, decode(encode(decode_exports(dec))))
    pre = PrefillCore(cfg, model, pools, eos)
    prompt = [(7 * i) % 1000 + 3 for i in range(args.prompt)]
    sampling = SamplingParams(temperature=1.0, seed=1, max_tokens=args.decode, ignore_eos=True)
    result: dict = {"prompt": args.prompt, "n": args.n, "decode": args.decode, "device": args.device}
    for run in range(2):  # the first of each warms up
        for name in ("separate", "shared"):
            rids = [f"{name}{run}-{i}" for i in range(args.n)]
            if name == "shared":
                siblings = [Sibling(rid, i + 2) for i, rid in enumerate(rids[1:])]
                box = pre.submit(Generate(rids[0], prompt, sampling, 0.0, siblings=siblings))
            else:
                box = [out for rid in rids for out in pre.submit(Generate(rid, prompt, sampling, 0.0))]
            first_s, all_s = pump(dec, pre, box, rids)
            result[name] = {"first_tokens_s": first_s, "finished_s": all_s}
    print(result)
    print(write_result("shared-prefill", result, args.out))


if __name__ == "__main__":
    main()
