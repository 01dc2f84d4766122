import gzip
import json
from pathlib import Path

from bench.trace_summary import between, exposed, kernels, summary


def _trace(path: Path) -> Path:
    """Two whole steps between three LM heads, a host gap before each step, a torch kernel in each."""
    events, ts = [], 0.0

    def kernel(name: str, dur: float, gap: float = 1.0) -> None:
        nonlocal ts
        ts += gap
        events.append({"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur})
        ts += dur

    kernel("nvjet_512x8_head", 300.0)
    for _ in range(2):
        kernel("void at::native::vectorized_elementwise_kernel<4>", 2.0, gap=5000.0)  # the host's gap first
        for _ in range(3):
            kernel("_copy_parts_kernel", 50.0)
            kernel("_down_kernel", 10.0)
        kernel("nvjet_512x8_head", 300.0)
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 1.0})  # not a kernel
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_steps_are_cut_at_the_head_and_the_host_gap(tmp_path: Path) -> None:
    text = summary(kernels(_trace(tmp_path / "t.trace.json.gz")))
    lines = text.splitlines()
    assert (
        lines[0] == "steps 2: device ms from the first kernel to the LM head 0.489, 0.489"
    )  # 2 + 7 gaps + 480
    assert "0.150 ms    0.150 exposed     3.0 a step    50.00 us  _copy_parts_kernel" in text
    assert "0.002 ms    0.002 exposed     1.0 a step     2.00 us  aten" in text
    assert lines[1] == "kernel time a step 0.482 ms, idle 0.007 ms"


def test_a_trace_without_two_heads_says_so(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(
        json.dumps({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": 1}]})
    )
    assert summary(kernels(path)).startswith("no two kernels")


def test_overlapping_kernels_add_only_what_they_extend() -> None:
    """A kernel launched while the one before it runs (programmatic dependent launch) adds only the time past
    the other's end; one inside another's span adds nothing; a gap is idle."""
    step = [
        {"name": "_gate_up_kernel", "ts": 0.0, "dur": 10.0},
        {"name": "_down_kernel", "ts": 6.0, "dur": 8.0},  # waits from 6 to 10: adds 4
        {"name": "_combine_kernel", "ts": 7.0, "dur": 2.0},  # inside down's span: adds nothing
        {"name": "_inject_kernel", "ts": 16.0, "dur": 3.0},  # after 2 idle
    ]
    added, idle = exposed(step)
    assert added == {"_gate_up_kernel": 10.0, "_down_kernel": 4.0, "_inject_kernel": 3.0}
    assert idle == 2.0


def test_by_grid_parts_one_kernel_by_its_launches() -> None:
    events = [
        {"name": "_gemv_kernel", "ts": 0.0, "dur": 10.0, "args": {"grid": [515, 1, 1]}},
        {"name": "_gemv_kernel", "ts": 11.0, "dur": 4.0, "args": {"grid": [80, 7, 1]}},
    ]
    assert set(exposed(events, by_grid=True)[0]) == {"_gemv_kernel [515, 1, 1]", "_gemv_kernel [80, 7, 1]"}
    assert exposed(events)[0] == {"_gemv_kernel": 14.0}


def test_between_steps_lists_the_kernels_after_the_head_and_the_idle_gap(tmp_path: Path) -> None:
    text = between(kernels(_trace(tmp_path / "t.trace.json.gz"))).splitlines()
    assert len(text) == 4  # two steps, each: the head's line and the step's first kernel (nothing between)
    assert text[0] == "after LM head 0: the next step starts 5000.0 us after its end"
    first = "void at::native::vectorized_elementwise_kernel<4>  (the step's first)"
    assert text[1] == f"  at +  5000.0 idle  5000.0 dur     2.0  {first}"
