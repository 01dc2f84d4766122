"""The `spillway` command as a user runs it: separate processes, real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.model.synthetic.checkpoint import make_model
from common.text.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "SPILLWAY_CACHE": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_generate_creates_and_uses_the_default_model(tmp_path: Path) -> None:
    first = _run(["generate", "--chat", "Hello there", "--max-tokens", "12", "--json"], tmp_path)
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    assert {"prompt_ids", "token_ids", "text", "tok_per_s"} <= set(out)
    model_dir = Path(out["model"])
    assert model_dir.parent == tmp_path / "models" and (model_dir / "config.json").is_file()
    tok = Tokenizer.from_dir(model_dir)
    assert out["prompt_ids"] == tok.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], tokenize=True
    )
    assert 1 <= len(out["token_ids"]) <= 12 and out["text"] == tok.decode(out["token_ids"])
    assert out["tok_per_s"] > 0

    again = _run(["generate", "--chat", "Hello there", "--max-tokens", "12", "--json"], tmp_path)
    assert json.loads(again.stdout)["token_ids"] == out["token_ids"]  # greedy by default, same model reused


@pytest.mark.slow
def test_make_model_then_generate_with_overrides(tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    made = _run(
        [
            "make-model",
            "--preset",
            "tiny",
            "--arch",
            "mixtral",
            "--set",
            "num_local_experts=5",
            "--set",
            "tie_word_embeddings=true",
            "--seed",
            "3",
            "--out",
            str(model_dir),
        ],
        tmp_path,
    )
    assert made.returncode == 0, made.stderr
    config = json.loads((model_dir / "config.json").read_text())
    assert config["num_local_experts"] == 5 and config["tie_word_embeddings"] is True
    gen = _run(
        [
            "generate",
            "--model",
            str(model_dir),
            "--prompt",
            "The cache",
            "--max-tokens",
            "5",
            "--temperature",
            "0.7",
            "--seed",
            "1",
            "--dtype",
            "bfloat16",
            "--json",
        ],
        tmp_path,
    )
    assert gen.returncode == 0, gen.stderr
    assert len(json.loads(gen.stdout)["token_ids"]) <= 5


def test_bad_model_dir_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text(json.dumps({"model_type": "nope"}))
    result = _run(["generate", "--model", str(tmp_path / "broken"), "--prompt", "x"], tmp_path)
    assert result.returncode == 2
    assert "model_type 'nope' is not supported" in result.stderr and "config.json" in result.stderr
    assert "Traceback" not in result.stderr


def test_writing_commands_refuse_a_non_empty_destination_without_force(tmp_path: Path) -> None:
    """make-model and convert keep what is there unless --force (which never removes convert's source)."""
    out = tmp_path / "m"
    assert _run(["make-model", "--arch", "qwen4_exp", "--out", str(out)], tmp_path).returncode == 0
    written = (out / "config.json").read_text()
    refused = _run(["make-model", "--arch", "qwen3_moe", "--out", str(out)], tmp_path)
    assert refused.returncode == 2 and "--force" in refused.stderr and "Traceback" not in refused.stderr
    assert (out / "config.json").read_text() == written
    bad = _run(["make-model", "--preset", "nope", "--force", "--out", str(out)], tmp_path)
    assert bad.returncode == 2 and (out / "config.json").read_text() == written  # checked before removing
    replaced = _run(["make-model", "--arch", "qwen3_moe", "--force", "--out", str(out)], tmp_path)
    assert (
        replaced.returncode == 0
        and json.loads((out / "config.json").read_text())["model_type"] == "qwen3_moe"
    )

    dst = tmp_path / "a"
    dst.mkdir()
    (dst / "note.txt").write_text("mine")
    refused = _run(["convert", str(out), str(dst), "--experts", "bf16"], tmp_path)
    assert refused.returncode == 2 and "--force" in refused.stderr and (dst / "note.txt").exists()
    assert _run(["convert", str(out), str(dst), "--experts", "bf16", "--force"], tmp_path).returncode == 0
    assert not (dst / "note.txt").exists() and (dst / "config.json").exists()
    itself = _run(["convert", str(out), str(out), "--experts", "bf16", "--force"], tmp_path)
    assert itself.returncode == 2 and "source" in itself.stderr and (out / "config.json").exists()


def test_simulate_checks_its_capacity_before_building_the_trace(tmp_path: Path) -> None:
    start = time.monotonic()
    result = _run(["simulate", "--trace", "synthetic-zipf", "--capacity", "1.7"], tmp_path)
    assert result.returncode == 2 and "capacity 1.7 is not a fraction in (0, 1]" in result.stderr
    assert time.monotonic() - start < 20  # the trace (tens of seconds) was never built


def test_bad_override_is_a_clear_error(tmp_path: Path) -> None:
    result = _run(["make-model", "--set", "num_experts", "--out", str(tmp_path / "x")], tmp_path)
    assert result.returncode == 2 and "num_experts" in result.stderr and "Traceback" not in result.stderr


def test_plan_of_flashnext_takes_seconds_and_writes_nothing(tmp_path: Path) -> None:
    """The preset's config alone, on the meta device: no 354 GB checkpoint, no weights loaded."""
    budget = 32 << 30
    args = ["plan", "--preset", "flashnext", "--vram-budget", "32GiB", "--expert-format", "int4"]
    start = time.monotonic()
    result = _run([*args, "--dtype", "bfloat16", "--json"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - start < 60
    plan = json.loads(result.stdout)
    assert plan["budget"] == budget and plan["ok"]
    assert plan["cache_slots"] > 0 and plan["total"] <= budget
    assert sum(plan["pools"].values()) == plan["total"]
    assert not any(tmp_path.iterdir())  # nothing written

    table = _run([*args, "--dtype", "bfloat16"], tmp_path)  # the human form: GiB per pool
    assert table.returncode == 0 and f"{plan['cache_slots']} of 24576 experts" in table.stdout
    assert "expert_cache" in table.stdout and "GiB" in table.stdout

    on_host = json.loads(
        _run([*args, "--dtype", "bfloat16", "--json", "--embeddings-on-host"], tmp_path).stdout
    )
    assert plan["pools"]["weights"] - on_host["pools"]["weights"] == 248320 * 2560 * 2  # the embedding, bf16
    assert on_host["cache_slots"] > plan["cache_slots"]

    refused = _run(
        [
            "plan",
            "--preset",
            "flashnext",
            "--vram-budget",
            "32GiB",
            "--dtype",
            "float32",
            "--expert-format",
            "bf16",
        ],
        tmp_path,
    )
    assert refused.returncode == 2 and "too small" in refused.stderr and "Traceback" not in refused.stderr
    assert "--expert-format int4" in refused.stderr and "--dtype bfloat16" in refused.stderr
    chosen = json.loads(
        _run(["plan", "--preset", "flashnext", "--vram-budget", "32GiB", "--json"], tmp_path).stdout
    )
    assert chosen["ok"] and (chosen["dtype"], chosen["expert_format"]) == ("bfloat16", "int4"), (
        "the defaults, as serve on CUDA: bfloat16, and (no format holds every expert) the most slots"
    )
    assert chosen["cache_slots"] == plan["cache_slots"]
    small = ["plan", "--preset", "qwen3-30b", "--vram-budget", "80GiB", "--json"]
    all_fit = json.loads(_run(small, tmp_path).stdout)
    assert all_fit["cache_slots"] == all_fit["max_cache_slots"] and all_fit["expert_format"] == "bf16"


def test_plan_of_qwen3_next_80b(tmp_path: Path) -> None:
    """Qwen3-Next-80B-A3B's config planned on a 24 GiB card: 48 layers of 512 experts, a part of them cached;
    make-model refuses the preset (plan only: ~159 GB) and writes nothing."""
    args = ["plan", "--preset", "qwen3-next-80b", "--vram-budget", "24GiB", "--json"]
    plan = json.loads(_run(args, tmp_path).stdout)
    assert plan["ok"] and plan["max_cache_slots"] == 48 * 512
    assert 0 < plan["cache_slots"] < plan["max_cache_slots"] and plan["total"] <= 24 << 30
    refused = _run(["make-model", "--preset", "qwen3-next-80b", "--out", str(tmp_path / "m")], tmp_path)
    assert refused.returncode == 2 and "qwen3_next" in refused.stderr and "Traceback" not in refused.stderr
    assert not (tmp_path / "m").exists()


def test_plan_counts_a_published_format_s_bytes(tmp_path: Path) -> None:
    """A preset planned with NVFP4 experts (4.5 bits a weight) holds more slots than with int4 (4.25 + the
    zeros: fewer), fewer than with 2-bit trellis codes; an unknown format is refused naming the choices."""
    args = ["plan", "--preset", "flashnext", "--vram-budget", "32GiB", "--dtype", "bfloat16", "--json"]
    slots = {
        fmt: json.loads(_run([*args, "--expert-format", fmt], tmp_path).stdout)["cache_slots"]
        for fmt in ("int4", "nvfp4", "trellis2")
    }
    assert slots["nvfp4"] < slots["int4"] < slots["trellis2"]
    refused = _run([*args, "--expert-format", "fp3"], tmp_path)
    assert (
        refused.returncode == 2
        and "unknown expert format 'fp3'" in refused.stderr
        and "nvfp4" in refused.stderr
    )


def test_plan_of_a_model_directory(tmp_path: Path) -> None:
    model_dir = make_model(tmp_path / "tiny", preset="tiny", arch="qwen2_moe")
    result = _run(
        ["plan", "--model", str(model_dir), "--vram-budget", "2G", "--max-running", "2", "--json"], tmp_path
    )
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["all_experts_fit"] and plan["cache_slots"] == plan["max_cache_slots"] == 3 * 8
    assert plan["total"] <= plan["budget"] == 2 << 30 and plan["max_running"] == 2

    bad = _run(["plan", "--model", str(model_dir), "--vram-budget", "lots"], tmp_path)
    assert bad.returncode == 2 and "not a number of bytes" in bad.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lend-arena"], "give --expert-cache"),
        (["--lend-arena", "--lend-kv", "--expert-cache", "3"], "one of"),
        (["--lookahead", "4"], "give --expert-cache"),
        (["--lookahead", "-1", "--expert-cache", "3"], "below 0"),
    ],
)
def test_serve_refuses_lending_that_cannot_hold(tmp_path: Path, flags: list[str], message: str) -> None:
    """(A model of its own: the embedded one is served through a cache unless told otherwise.)"""
    model = make_model(tmp_path / "m", preset="tiny", arch="qwen3_moe")
    result = _run(["serve", "--port", "1", "--model", str(model), *flags], tmp_path)
    assert result.returncode == 2 and message in result.stderr and "started" not in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["serve", "--port", "1", "--max-running", "0"], "--max-running: 0 is below 1"),
        (["serve", "--port", "1", "--device", "gpu"], "'gpu' is not a device"),
        (["serve", "--port", "1", "--device", "cuda:7"], "no CUDA device is available here"),
        (["serve", "--port", "1", "--ray", "local", "--device", "cuda:1"], "one GPU of its node"),
        (
            ["serve", "--port", "1", "--ray", "local", "--vram-budget", "100MiB", "--device", "auto"],
            "too small",
        ),
        (["serve", "--port", "1", "--expert-cache", "abc"], "--expert-cache must be"),
        (["serve", "--port", "1", "--stall-timeout", "-1"], "below 0"),
        (["generate", "--max-tokens", "0"], "--max-tokens: 0 is below 1"),
        (["generate", "--prefill-chunk", "0"], "--prefill-chunk: 0 is below 1"),
        (["generate", "--record-routing", "/nonexistent/x.json"], "does not exist"),
        (["plan", "--preset", "tiny", "--vram-budget", "8GiB", "--max-context", "-5"], "-5 is below 2"),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(
    tmp_path: Path, args: list[str], message: str
) -> None:
    result = _run(args, tmp_path)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "started" not in result.stderr


def test_serve_refuses_a_taken_port_before_starting(tmp_path: Path) -> None:
    """Another server on the port: one clear error, where the router failed to bind after everything else
    had started (and the launcher took the other server's /health for its own)."""
    import socket

    from common.ipc.ports import free_ports

    with socket.socket() as other:
        other.bind(("127.0.0.1", free_ports(1)))
        other.listen()
        port = other.getsockname()[1]
        result = _run(["serve", "--port", str(port)], tmp_path)
    assert result.returncode == 2 and f"--port: 127.0.0.1:{port} cannot be bound" in result.stderr
    assert "Traceback" not in result.stderr and "started" not in result.stderr


def test_serve_refuses_a_small_budget_before_starting(tmp_path: Path) -> None:
    result = _run(["serve", "--vram-budget", "100MiB", "--port", "1"], tmp_path)
    assert result.returncode == 2 and "too small" in result.stderr and "Traceback" not in result.stderr
    assert "started" not in result.stderr  # no process was launched


def test_serve_refuses_a_corrupt_shard_before_starting(tmp_path: Path) -> None:
    """A shard cut short: one error naming it, before any process starts (not a decode worker that fails
    to load, restarted until the launcher gives up)."""
    model = make_model(tmp_path / "m", preset="tiny", arch="qwen3_moe")
    shard = sorted(model.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    result = _run(["serve", "--model", str(model), "--port", "1"], tmp_path)
    assert result.returncode == 2 and f"file {shard}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "started" not in result.stderr


@pytest.mark.slow
def test_generate_sizes_its_cache_from_the_budget(tmp_path: Path) -> None:
    result = _run(
        ["generate", "--vram-budget", "2GiB", "--prompt", "The cache", "--max-tokens", "4"], tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "cache slots" in result.stderr and "1 process on the device" in result.stderr


def test_bench_runs_a_benchmark_by_name_and_writes_its_result(tmp_path):
    root = Path(__file__).resolve().parents[2]
    trace = "synthetic-zipf:layers=2,experts=16,top_k=2,tokens=64"
    argv = [sys.executable, "-m", "services.cli", "bench", "policy", "--trace", trace, "--out", str(tmp_path)]
    done = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "policy.json").read_text())
    assert result["command"].startswith("python -m bench.policy") and result["misses"]["belady"] >= 0
    elsewhere = subprocess.run(
        [sys.executable, "-m", "services.cli", "bench", "policy"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert elsewhere.returncode == 2 and "repository root" in elsewhere.stderr
