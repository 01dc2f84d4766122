"""What every benchmark records: the exact command, the commit, the GPU and the date."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from common.kv.state import StatePool

RESULTS = Path(__file__).resolve().parent / "results"


def provenance() -> dict:
    """command, commit, gpu and date of this run."""
    # SPILLWAY_COMMIT first: a copy of the tree on another machine may carry a stale .git or none
    commit = os.environ.get("SPILLWAY_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
            ).stdout
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    module = sys.modules["__main__"].__spec__
    argv = ["-m", module.name, *sys.argv[1:]] if module is not None else sys.argv
    return {
        "command": " ".join(["python", *argv]),
        "commit": commit.strip(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


_STARTED = time.perf_counter()


def progress(stage: str) -> None:
    """One line on stderr, flushed at once, with the seconds since the benchmark started: a run killed by a
    time limit still shows how far it got (its results print only at the end)."""
    print(f"[{time.perf_counter() - _STARTED:7.1f} s] {stage}", file=sys.stderr, flush=True)


def write_result(name: str, result: dict, out_dir: Path | None = None) -> Path:
    """bench/results/<name>.json (or under out_dir), provenance first."""
    path = (out_dir or RESULTS) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"name": name, **provenance(), **result}, indent=2) + "\n")
    return path


def median_ms(run, repeats: int = 5) -> float:
    """ms of one `run()` on the current stream, timed by CUDA events: the median of `repeats` runs."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def measure_pcie_gbps(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Steady-state host→device copy rate from page-locked memory, GB/s (median of `repeats`)."""
    from common.ipc.hostmem import register_mapped, unregister

    host = torch.empty(nbytes, dtype=torch.uint8)
    register_mapped(host)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)  # warm-up
    ms = median_ms(lambda: dev.copy_(host, non_blocking=True), repeats)
    unregister(host)
    return nbytes / (ms / 1e3) / 1e9


def measure_hbm_gbps(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Device-to-device copy rate (read + write bytes), GB/s."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    return 2 * nbytes / (median_ms(lambda: b.copy_(a), repeats) / 1e3) / 1e9


def write_profile(run, path: Path) -> None:
    """Op tables of what `run()` does on the GPU, by device time then by host time, then the ops by self
    device time with their input shapes (which launched the small kernels: in an eager run; ops replayed
    in a CUDA graph show as kernels alone), written to `path`; the timeline (Chrome trace format: which
    kernel waited on which stream) beside it, as `<path>.trace.json` (`python -m bench.trace_summary`)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        run()
        torch.cuda.synchronize()
    table = prof.key_averages()
    path.write_text(
        table.table(sort_by="cuda_time_total", row_limit=40)
        + "\n"
        + table.table(sort_by="self_cpu_time_total", row_limit=40)
        + "\n"
        + op_table(prof)
    )
    prof.export_chrome_trace(str(path.with_name(path.name + ".trace.json")))


def op_table(prof, rows: int = 60, frames: int = 0) -> str:
    """A finished profile's ops by self device time, one row per op and input shapes (and, with `frames`
    and a profile taken `with_stack`, per call site's last frames)."""
    groups = prof.key_averages(group_by_input_shape=True, group_by_stack_n=frames)
    return groups.table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=40)


def replay_us(run, replays: int = 20, between=None) -> float:
    """µs per replay of `run()` recorded as one CUDA graph (after one eager call that compiles its kernels);
    `between()` runs before each timed replay, outside the graph (e.g. new inputs in place)."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        if between is not None:
            between()
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def measure_tflops(n: int = 8192, repeats: int = 5) -> float:
    """Dense bf16 GEMM rate, TFLOP/s (median of `repeats`)."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    a @ b  # warm-up
    return 2 * n**3 / (median_ms(lambda: a @ b, repeats) / 1e3) / 1e12


def step_weight_bytes(model: torch.nn.Module, rows: int, device_type: str = "cuda") -> int:
    """Bytes of the model's device weights one decode step of `rows` tokens reads (bench/README.md's
    hbm_bytes, less experts and KV): the union of its parameters' and buffers' bytes on the device (a fused
    projection and its Linears' views of it count once), an embedding table only for the `rows` rows it
    gathers, unless a head reads all of it (tied weights)."""
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    spans: list[tuple[int, int]] = []
    for module in model.modules():
        for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            if t.device.type != device_type or t.numel() == 0:
                continue
            nbytes = t.numel() * t.element_size()
            if isinstance(module, torch.nn.Embedding) and (head is None or head.data_ptr() != t.data_ptr()):
                nbytes = min(nbytes, rows * t.shape[1] * t.element_size())
            spans.append((t.data_ptr(), t.data_ptr() + nbytes))
    total, reach = 0, 0
    for start, end in sorted(spans):
        total += max(0, end - max(start, reach))
        reach = max(reach, end)
    return total


def step_state_bytes(
    pool: StatePool, lanes: int, context: float, budget: int | None = None, ratio: int = 1
) -> float:
    """Bytes of per-sequence state one decode step of `lanes` lanes at `context` tokens each must read
    (bench/README.md: the state read, not in step_weight_bytes), in the pool's own dtypes: every layer's
    fixed-size state whole (Gated DeltaNet's recurrent and conv states, the PLE's history), the keys and
    values its attention reads (the whole context, or for a layer with a QSA indexer at most its selection
    `budget` of tokens), and such an indexer's block keys (one per `ratio` tokens) and the raw keys of the
    block it compresses. Reads only: the states written back are not counted."""
    total = 0.0
    for layer in pool.layers:
        total += sum(t[0].numel() * t.element_size() for t in layer.slots.values())
        indexed = "index_block" in layer.paged
        for name, pages in layer.paged.items():
            if name == "index_block":
                tokens = context / ratio
            elif name == "index_k":
                tokens = ratio
            else:
                tokens = min(context, budget) if indexed and budget is not None else context
            total += tokens * pages[0, 0].numel() * pages.element_size()
    return lanes * total
