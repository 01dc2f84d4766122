"""A diagnostic aid for prefill on the GPU: where a layer-major prefill waits for the host, and which modules
hold its memory peak. flashnext cut to `--layers` (the per-layer activations are the full model's), one
prompt prefilled as the engine runs it (`ModelRunner.prefill_groups`), after a warm-up.

    python -m bench.prefill_probe syncs [--layers 4] [--prompt 25600]
    python -m bench.prefill_probe memory [--layers 4] [--prompt 131072]
    python -m bench.prefill_probe kernels [--layers 4] [--prompt 25600]
    python -m bench.prefill_probe gaps [--layers 4] [--prompt 25600]

`syncs`: torch's sync debug mode on during the prompt; each call site that synchronised (the last frames of
its Python stack), with its count. Every one drains the GPU's queue while the host catches up (prefill-25k
at 4009b49: 854 of them, ~0.66 s of its 3.35 s).
`memory`: per module (four levels deep; a layer-major pass calls the layers' halves, not the layers and
their hyper-connections, so those rows are absent), the peak allocated above what was allocated when it was
entered, largest first; and what is reserved after the prompt against what was allocated before it (the gap
beyond the largest peak is what the caching allocator keeps cached: prefill-128k at 4009b49 reserved 41.6 GiB
of a 32 GiB plan; a 4-layer probe, 28.8 GiB for ~13.5 allocated, the indexer the largest module peak).
`kernels`: torch ops by GPU time spent in them, grouped by input shapes and the last frames of their Python
stack: which line launched the small kernels a kernel-name profile (bench.prefill --profile) only counts.
`gaps`: where the compute stream (the stream with the most kernel time) sits idle: the time between its
kernels, in total and the longest gaps with the kernels on either side (the profile's kernel times add up
to less than the prompt's time by what is idle).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import tempfile
import traceback
import warnings
from pathlib import Path

import torch

from bench.common import op_table
from bench.flashnext import GIB, build_flashnext, warm_prefill
from common.config import LAYER_MAJOR_TOKENS, PREFILL_CHUNK


def sync_sites(run, frames: int = 7) -> collections.Counter:
    """Call sites (the last `frames` project or library frames) of each host synchronisation in `run()`."""
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        stack = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
        where = [f"{'/'.join(f.filename.split('/')[-2:])}:{f.lineno} {f.name}" for f in stack[-frames:]]
        sites[" <- ".join(reversed(where))] += 1

    shown, mode = warnings.showwarning, torch.cuda.get_sync_debug_mode()
    warnings.showwarning = record
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode(mode)
            warnings.showwarning = shown
    return sites


def kernel_sites(run, rows: int = 45, frames: int = 4) -> str:
    """A table of the ops in `run()` by self GPU time, each row one op, input shapes and call site."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, record_shapes=True, with_stack=True) as prof:
        run()
    return op_table(prof, rows, frames)


def stream_gaps(run, rows: int = 30) -> str:
    """The compute stream's idle time in `run()`: total, and the longest gaps with their neighbours."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        run()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    work = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy")]
    busy: collections.Counter = collections.Counter()
    for e in work:
        busy[e["args"]["stream"]] += e["dur"]
    stream = busy.most_common(1)[0][0]  # compute outweighs the copies (prefill-25k: 1.8 s against 1.1 s)
    ks = sorted((e for e in work if e["args"]["stream"] == stream), key=lambda e: e["ts"])
    gaps = [(b["ts"] - a["ts"] - a["dur"], a["name"], b["name"]) for a, b in itertools.pairwise(ks)]
    span, idle = ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"], sum(g for g, *_ in gaps if g > 0)
    lines = [
        f"compute stream {stream}: {span / 1e3:.1f} ms from its first kernel to its last, "
        f"{busy[stream] / 1e3:.1f} ms busy, {idle / 1e3:.1f} ms idle between {len(ks)} kernels"
    ]
    lines += [f"stream {s}: {t / 1e3:.1f} ms of kernels and copies" for s, t in busy.items() if s != stream]
    for g, before, after in sorted(gaps, reverse=True)[:rows]:
        lines.append(f"{g / 1e3:8.3f} ms  after {before[:60]}  before {after[:60]}")
    return "\n".join(lines)


def module_peaks(model: torch.nn.Module, run, depth: int = 4) -> dict[str, int]:
    """Per module up to `depth` levels: the peak bytes allocated above its entry during `run()`. The peak
    counter is reset at each entry; the enclosing modules fold their children's peaks back in."""
    peaks: dict[str, int] = {}
    stack: list[list[int]] = []  # [allocated at entry, peak so far]

    def enter(module, args) -> None:
        if stack:
            stack[-1][1] = max(stack[-1][1], torch.cuda.max_memory_allocated())
        now = torch.cuda.memory_allocated()
        stack.append([now, now])
        torch.cuda.reset_peak_memory_stats()

    def leave(module, args, out) -> None:
        start, peak = stack.pop()
        peak = max(peak, torch.cuda.max_memory_allocated())
        if stack:
            stack[-1][1] = max(stack[-1][1], peak)
        name = names[module]
        peaks[name] = max(peaks.get(name, 0), peak - start)

    names = {m: n or "model" for n, m in model.named_modules() if n.count(".") < depth}
    hooks = [h for m in names for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return peaks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("syncs", "memory", "kernels", "gaps"))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=25600)
    ap.add_argument("--budget-gib", type=float, default=32.0)
    args = ap.parse_args()

    flash = build_flashnext(args.layers, args.budget_gib, 1, args.prompt + 16, args.prompt)
    runner, cfg = flash.runner, flash.cfg
    warm_prefill(flash, {min(PREFILL_CHUNK, args.prompt), args.prompt % PREFILL_CHUNK})
    prompt = torch.randint(3, cfg.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(1))

    def prefill() -> None:
        runner.prefill_groups(runner.new_sequence(), prompt.tolist(), PREFILL_CHUNK, LAYER_MAJOR_TOKENS)
        torch.cuda.synchronize()

    if args.what == "syncs":
        sites = sync_sites(prefill)
        print(f"{sum(sites.values())} host synchronisations in a {args.prompt}-token prefill")
        for site, n in sites.most_common(40):
            print(f"{n:6d}  {site}")
        return
    if args.what == "kernels":
        print(kernel_sites(prefill))
        return
    if args.what == "gaps":
        print(stream_gaps(prefill))
        return
    base = torch.cuda.memory_allocated()
    peaks = module_peaks(flash.model, prefill)
    reserved = torch.cuda.memory_reserved()  # the cached blocks stay: about the prompt's peak
    print(f"allocated before the prompt {base / GIB:.2f} GiB; reserved after it {reserved / GIB:.2f} GiB")
    for name, peak in sorted(peaks.items(), key=lambda kv: -kv[1])[:30]:
        print(f"{peak / GIB:8.3f} GiB  {name}")


if __name__ == "__main__":
    main()
