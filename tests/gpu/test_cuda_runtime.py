"""The runtime on CUDA tensors: same logits as transformers on the GPU, and the CLI with --device cuda."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.config import WorkerConfig
from common.engine.engine import Engine
from common.ipc.hostmem import host_list_to
from common.model.synthetic.checkpoint import make_model
from common.protocol import SamplingParams

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
@torch.inference_mode()
def test_cuda_matches_transformers(arch: str, tmp_path: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    model_dir = make_model(tmp_path / arch, preset="tiny", arch=arch)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    engine = Engine(WorkerConfig(str(model_dir), device="cuda", max_running=2, max_context=64))
    prompts = [[5, 17, 300, 42, 8, 9, 10], [700, 3, 4]]
    seqs = [engine.runner.new_sequence() for _ in prompts]
    ours = engine.runner.forward(seqs, prompts, all_logits=True)
    assert ours.is_cuda
    ref = torch.cat([hf(torch.tensor([p], device="cuda")).logits[0] for p in prompts]).float()
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4
    for seq in seqs:
        engine.runner.release(seq)

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    hf.generation_config.eos_token_id = None
    for prompt, result in zip(prompts, engine.generate(prompts, params), strict=True):
        expected = hf.generate(
            torch.tensor([prompt], device="cuda"), do_sample=False, max_new_tokens=24, pad_token_id=0
        )
        assert result.token_ids == expected[0, len(prompt) :].tolist()


def test_cli_generate_on_cuda(tmp_path: Path) -> None:
    env = {**os.environ, "SPILLWAY_CACHE": str(tmp_path)}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "generate",
            "--device",
            "cuda",
            "--dtype",
            "bfloat16",
            "--chat",
            "Hello",
            "--max-tokens",
            "16",
            "--json",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert len(out["token_ids"]) >= 1 and out["tok_per_s"] > 0


def test_cap_allocator_is_a_hard_cap() -> None:
    """Past the cap the allocator frees its cached blocks and retries; live tensors beyond it raise."""
    from common.engine.memory_plan import cap_allocator

    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    cap_allocator(base + (1 << 30), "cuda")
    try:
        kept = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
        for size in (300 << 20, 400 << 20):  # blocks of sizes that never come back, as a growing context's
            torch.empty(size, dtype=torch.uint8, device="cuda")
        assert torch.cuda.memory_reserved() <= base + (1 << 30)
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(600 << 20, dtype=torch.uint8, device="cuda")
        del kept
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def test_serve_workers_cap_their_part_of_the_budget(tmp_path: Path) -> None:
    """`cap_worker` in a fresh process, as each serve worker starts: prefill's allocator gets expandable
    segments and its part of the budget; decode's, fixed segments and the rest; allocations past a cap
    raise."""
    model_dir = make_model(tmp_path / "m", preset="tiny")
    code = (
        "import sys, torch\n"
        "from common.config import WorkerConfig\n"
        "from common.engine.memory_plan import cap_worker\n"
        f"cfg = WorkerConfig(model_dir={str(model_dir)!r}, device='cuda', vram_budget=2 << 30,"
        " max_context=256, max_running=2, expert_format='bf16')\n"
        "plan = cap_worker(cfg, sys.argv[1])\n"
        "cap = plan.process_budget(sys.argv[1])\n"
        "x = torch.empty(cap // 2, dtype=torch.uint8, device='cuda')\n"
        "expandable = all(s['is_expandable'] for s in torch.cuda.memory._snapshot()['segments'])\n"
        "try:\n"
        "    torch.empty(cap, dtype=torch.uint8, device='cuda')\n"
        "    print(expandable, 'no cap')\n"
        "except torch.OutOfMemoryError:\n"
        "    print(expandable, 'capped')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    for role, expandable in (("prefill", True), ("decode", False)):
        out = subprocess.run(
            [sys.executable, "-c", code, role], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == [str(expandable), "capped"], role


def test_host_list_to_copies_without_waiting_for_the_stream() -> None:
    """A host list reaches the GPU through pinned memory, asynchronously: no host wait for queued work, the
    values and dtype as given."""
    busy = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            busy = busy @ busy / 64  # queued work a pageable copy would wait for
        got = host_list_to([3, 1, 4], "cuda", torch.int32)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.dtype == torch.int32 and got.tolist() == [3, 1, 4]
