"""What a decode profile's timeline says (the `<profile>.trace.json` `--profile` writes beside its tables).

The op tables sum each kernel's time; in a CUDA graph they cannot say which kernels the step waited on. The
timeline can: steps are cut at the LM head's GEMM (the step's last large kernel) and the host gap before
each step's first kernel; per step, the device time from its first kernel to its LM head, and each kernel's
time, exposed time (what it adds to the step: `exposed`) and count, largest first (small torch kernels
pooled as `aten`).

    python -m bench.trace_summary FILE.trace.json[.gz] [--head 512x8] [--rows 30] [--by-grid]
    python -m bench.trace_summary FILE.trace.json[.gz] --between   # what runs between two steps
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter
from itertools import pairwise
from pathlib import Path


def kernels(path: Path) -> list[dict]:
    """The trace's kernel events, by start time."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    found = [e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]
    return sorted(found, key=lambda e: e["ts"])


def kernel_name(name: str) -> str:
    """A kernel's name, torch's templated elementwise kernels pooled as `aten`."""
    return "aten" if name.startswith(("void at::", "void (anonymous")) else name[:60]


def steps(events: list[dict], head: str) -> list[list[dict]]:
    """Each whole step's kernels: after an LM head (a kernel whose name holds `head`), from the first
    kernel after the largest host gap, up to and with the next LM head."""
    heads = [i for i, e in enumerate(events) if head in e["name"]]
    out = []
    for a, b in pairwise(heads):
        seg = events[a : b + 1]  # from the last step's head: the host's gap may follow it at once
        gaps = [seg[i + 1]["ts"] - seg[i]["ts"] - seg[i]["dur"] for i in range(len(seg) - 1)]
        out.append(seg[max(range(len(gaps)), key=gaps.__getitem__) + 1 :])
    return out


def label(e: dict, by_grid: bool = False) -> str:
    """A kernel event's row: its name (`kernel_name`), with `by_grid` its launch grid too (one kernel's
    launches of different weights apart: the GEMV's projections)."""
    name = kernel_name(e["name"])
    return f"{name} {e.get('args', {}).get('grid')}" if by_grid else name


def exposed(step: list[dict], by_grid: bool = False) -> tuple[Counter, float]:
    """Per kernel name, the time its kernels add to the step: how far each one's end moves past the latest
    end before it (kernels by start). With programmatic dependent launch a kernel starts while the one before
    it runs and its time includes its wait, so summed durations exceed the step; these sum to it, less the
    idle time (the second value, µs), where no kernel runs."""
    added, idle, end = Counter(), 0.0, step[0]["ts"]
    for e in step:
        finish = e["ts"] + e["dur"]
        if finish > end:
            added[label(e, by_grid)] += finish - max(e["ts"], end)
            idle += max(0.0, e["ts"] - end)
            end = finish
    return added, idle


def summary(events: list[dict], head: str = "512x8", rows: int = 30, by_grid: bool = False) -> str:
    """Per-step device time and the kernels' time, exposed time (`exposed`) and count a step, as text."""
    cut = steps(events, head)
    if not cut:
        return f"no two kernels named like {head!r}: no whole step"
    time, count, added, idle = Counter(), Counter(), Counter(), 0.0
    for step in cut:
        for e in step:
            time[label(e, by_grid)] += e["dur"]
            count[label(e, by_grid)] += 1
        step_added, step_idle = exposed(step, by_grid)
        added.update(step_added)
        idle += step_idle
    n = len(cut)
    walls = [(s[-1]["ts"] + s[-1]["dur"] - s[0]["ts"]) / 1e3 for s in cut]
    lines = [
        f"steps {n}: device ms from the first kernel to the LM head {', '.join(f'{w:.3f}' for w in walls)}"
    ]
    lines.append(f"kernel time a step {sum(time.values()) / n / 1e3:.3f} ms, idle {idle / n / 1e3:.3f} ms")
    for name, us in time.most_common(rows):
        lines.append(
            f"{us / n / 1e3:8.3f} ms {added[name] / n / 1e3:8.3f} exposed {count[name] / n:7.1f} a step "
            f"{us / count[name]:8.2f} us  {name}"
        )
    return "\n".join(lines)


def between(events: list[dict], head: str = "512x8") -> str:
    """What lies between each LM head and the next whole step's first kernel (the kernels outside the
    recorded step: sampling; and the idle gap before the next step), as text: per kernel its start after the
    head's end, the idle time before it and its duration, µs, and its name (torch's not pooled)."""
    cut = steps(events, head)
    if not cut:
        return f"no two kernels named like {head!r}: no whole step"
    heads = [i for i, e in enumerate(events) if head in e["name"]]
    lines = []
    for n, (a, step) in enumerate(zip(heads, cut, strict=False)):
        end = start = events[a]["ts"] + events[a]["dur"]
        lines.append(f"after LM head {n}: the next step starts {step[0]['ts'] - start:.1f} us after its end")
        for e in events[a + 1 : events.index(step[0]) + 1]:
            lines.append(
                f"  at +{e['ts'] - start:8.1f} idle {max(0.0, e['ts'] - end):7.1f} dur {e['dur']:7.1f}  "
                f"{e['name'][:60]}" + ("  (the step's first)" if e is step[0] else "")
            )
            end = max(end, e["ts"] + e["dur"])
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace", type=Path)
    ap.add_argument("--head", default="512x8", help="a substring of the LM head GEMM's kernel name")
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--by-grid", action="store_true", help="a row per kernel and launch grid")
    ap.add_argument(
        "--between",
        action="store_true",
        help="instead: the kernels and idle time between a step and the next",
    )
    args = ap.parse_args()
    events = kernels(args.trace)
    print(between(events, args.head) if args.between else summary(events, args.head, args.rows, args.by_grid))


if __name__ == "__main__":
    main()
