"""peer-hf: Spillway against HF transformers + accelerate offload on the same checkpoint and VRAM budget, in
one script: the synthetic `qwen3-30b` (bf16, ~61 GB), greedy decode of one request.

    python -m bench.peer_hf [--budget-gib 32] [--layers 48] [--prompt 256] [--decode 32] [--out DIR]
    python -m bench.peer_hf --dense-ab [...]   # Spillway: moe_dense off, then on

HF: `from_pretrained(device_map="auto", max_memory={0: budget, "cpu": ...})` — accelerate keeps what fits on
the GPU and runs the rest from host memory, moving those weights over PCIe at every forward. Spillway: the
memory plan for the same budget sizes the VRAM expert cache (bf16 experts in mapped host memory), decode
passes recorded as CUDA graphs. Each system's decode rate is (tokens after the first) / (time of a greedy
generation of `--decode` tokens − time of a generation of one token), both after a warm-up generation.
Routing is the model's own (random weights route near-uniformly: a hard case for any cache).
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.common import measure_pcie_gbps, progress, write_result
from common.model.synthetic.checkpoint import make_model

GIB = 1 << 30


def hf_decode_rate(model_dir: Path, budget_gib: float, prompt: list[int], tokens: int) -> float:
    """Decode tok/s of transformers with accelerate's offload under the budget."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        dtype=torch.bfloat16,
        device_map="auto",
        max_memory={0: f"{int(budget_gib * 1024)}MiB", "cpu": "120GiB"},
    )
    ids = torch.tensor([prompt], device="cuda")

    def generate(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    return decode_rate(generate, tokens)


def spillway_decode_rate(
    model_dir: Path, budget_gib: float, prompt: list[int], tokens: int, dense_kernels: bool = True
) -> dict:
    """Decode tok/s of Spillway's engine under the budget (the plan sizes the expert cache); `dense_kernels`
    False: torch's gather path instead of common/kernels/moe_dense.py (`KernelConfig.moe_dense`)."""
    from common.config import WorkerConfig
    from common.engine.engine import Engine
    from common.kernels.config import KERNELS
    from common.protocol import SamplingParams
    from common.workers.decode import apply_memory_plan

    cfg = WorkerConfig(
        model_dir=str(model_dir), device="cuda", dtype="bfloat16", max_running=1,
        max_context=len(prompt) + tokens + 16, vram_budget=int(budget_gib * GIB),
        kernels=replace(KERNELS, moe_dense=dense_kernels),
    )  # fmt: skip
    cfg, plan = apply_memory_plan(cfg)
    engine = Engine(cfg)

    def generate(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate([prompt], params)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    rate = decode_rate(generate, tokens)
    counters = {k: int(v.sum()) for k, v in engine.offload.tables.counters.items()}
    return {"tok_per_s": rate, "cache_slots": plan.cache_slots, **counters}


def decode_rate(generate, tokens: int) -> float:
    """(tokens − 1) / (time of `generate(tokens)` − time of `generate(1)`), after a warm-up generation."""
    generate(2)
    return (tokens - 1) / (generate(tokens) - generate(1))


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-gib", type=float, default=32.0)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--model-dir", type=Path, default=None,
        help="the checkpoint directory: written unless it holds one already (default: a temporary one)",
    )  # fmt: skip
    ap.add_argument(
        "--dense-ab", action="store_true",
        help="no HF: Spillway's decode with the dense MoE kernels off, then on (KernelConfig.moe_dense)",
    )  # fmt: skip
    args = ap.parse_args()

    pcie = measure_pcie_gbps()
    layers = {"num_hidden_layers": args.layers}
    model_dir = args.model_dir or Path(tempfile.mkdtemp()) / "qwen3-30b"
    if not (model_dir / "config.json").exists():
        make_model(model_dir, preset="qwen3-30b", overrides=layers)
    progress(f"checkpoint written: {model_dir}")
    prompt = torch.randint(3, 30000, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    if args.dense_ab:
        return dense_ab(model_dir, prompt, pcie, args)
    spillway = spillway_decode_rate(model_dir, args.budget_gib, prompt, args.decode)
    progress(f"spillway: {spillway}")
    _free()  # the engine and its pinned store go before transformers loads
    torch.cuda.reset_peak_memory_stats()
    hf = hf_decode_rate(model_dir, args.budget_gib, prompt, args.decode)
    progress(f"hf: {hf:.3f} tok/s")
    result = {
        "ratio": spillway["tok_per_s"] / hf,
        "spillway": spillway,
        "hf": {"tok_per_s": hf, "max_memory_reserved_gib": torch.cuda.max_memory_reserved() / GIB},
        "pcie_gbps": pcie,
        "budget_gib": args.budget_gib,
        "layers": args.layers,
        "prompt": args.prompt,
        "decode": args.decode,
    }
    print(write_result("peer-hf", result, args.out))
    print(f"spillway {spillway['tok_per_s']:.2f} tok/s, hf {hf:.3f} tok/s, ratio {result['ratio']:.1f}")


def dense_ab(model_dir: Path, prompt: list[int], pcie: float, args: argparse.Namespace) -> None:
    """Spillway's decode rate with torch's gather path, then with the in-place dense kernels, one engine at a
    time on the same checkpoint and budget."""
    runs = {}
    for name, dense in (("torch-gather", False), ("moe-dense", True)):
        runs[name] = spillway_decode_rate(model_dir, args.budget_gib, prompt, args.decode, dense)
        progress(f"{name}: {runs[name]}")
        _free()
    result = {
        "speedup": runs["moe-dense"]["tok_per_s"] / runs["torch-gather"]["tok_per_s"],
        **runs,
        "pcie_gbps": pcie,
        "budget_gib": args.budget_gib,
        "layers": args.layers,
        "prompt": args.prompt,
        "decode": args.decode,
    }
    print(write_result(f"peer-hf-dense-ab-{args.budget_gib:g}gib", result, args.out))
    print(f"moe_dense / torch gather: {result['speedup']:.3f}")


if __name__ == "__main__":
    main()
