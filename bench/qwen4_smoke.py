"""Flash-Next's text model cut to a few layers, built in memory, all experts resident: prefill, greedy decode.

A functional run at full width (not the PCIe-limited path: experts are all in VRAM, the MoE is the torch
reference): memory by component, prefill and decode throughput.

    python -m bench.qwen4_smoke --layers 8 --prompt 4096 --decode 64 [--out DIR]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.common import write_result
from common.engine.runner import ModelRunner
from common.model.hf_config import parse_architecture
from common.model.loader import build_model
from common.model.synthetic.checkpoint import synthetic_tensors
from common.model.synthetic.config import model_config


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ngram-base", type=int, default=2_000_000)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    overrides = {"num_hidden_layers": args.layers, "ngram_vocab_size_base": args.ngram_base}
    hf = model_config("flashnext", "qwen4_exp", overrides)
    arch, cfg = parse_architecture(hf, Path("<flashnext in memory>"))
    start = time.perf_counter()
    source = ((Path("<synthetic>"), key, lambda t=t: t) for key, t in synthetic_tensors(hf, seed=0))
    model = build_model(arch, cfg, source, Path("<synthetic>"), dtype=torch.bfloat16, device="cuda")
    build_s = time.perf_counter() - start
    experts = next(layer.mlp.experts for layer in model.model.layers)
    tables = [layer.ple.table for layer in model.model.layers if layer.ple is not None]
    runner = ModelRunner(model, max_running=1, max_context=args.prompt + args.decode + 16)
    memory = {
        "resident_weights_gib": _bytes(model.parameters()) / 2**30,
        "experts_gib": _bytes(t for w in experts.weights.values() for t in (w.gate_up, w.down)) / 2**30,
        "state_pool_gib": _bytes(
            t for lay in runner.pool.layers for t in (*lay.paged.values(), *lay.slots.values())
        )
        / 2**30,
        "ngram_table_host_gib": _bytes(t.rows for t in tables) / 2**30,
    }

    prompt = torch.randint(
        3, cfg.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    seq = runner.new_sequence()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    logits = runner.forward([seq], [prompt])
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    token = int(logits.argmax(-1))
    t0 = time.perf_counter()
    for _ in range(args.decode):
        logits = runner.forward([seq], [[token]])
        token = int(logits.argmax(-1))
    torch.cuda.synchronize()
    decode_s = time.perf_counter() - t0
    result = {
        "layers": args.layers,
        "prompt_tokens": args.prompt,
        "decode_tokens": args.decode,
        "build_s": build_s,
        "prefill_s": prefill_s,
        "prefill_tok_per_s": args.prompt / prefill_s,
        "decode_tok_per_s": args.decode / decode_s,
        "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        **memory,
    }
    print(write_result(f"qwen4_smoke_{args.layers}l", result, args.out))
    for k, v in result.items():
        print(f"{k:>28}: {v:.3f}" if isinstance(v, float) else f"{k:>28}: {v}")


if __name__ == "__main__":
    main()
