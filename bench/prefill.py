"""prefill-25k / prefill-128k: flashnext int4 under a 32 GiB budget, a 25,600- (or 131,072-) token prompt,
nothing cached: TTFT, prefill tok/s, bytes streamed, and the limit max(streamed / PCIe, flops / bf16 GEMM
rate), both ceilings measured in the same run.

    python -m bench.prefill --prompt 25600 [--chunk 8192] [--layer-major-tokens 32768] [--no-fused]
        [--layers 48] [--out DIR] [--profile FILE]

The prompt is prefilled as the engine does: in chunks of `--chunk` tokens, grouped layer-major by
`--layer-major-tokens` (`ModelRunner.prefill_groups`). Flops count the resident weights
that a token multiplies (not the embedding), its k experts, and attention over the keys each query sees (QSA:
at most the indexer's budget plus a block).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.common import measure_tflops, progress, write_profile, write_result
from bench.flashnext import GIB, build_flashnext, warm_prefill
from common.config import LAYER_MAJOR_TOKENS
from common.engine.memory_plan import use_expandable_segments


def prefill_flops(model: torch.nn.Module, cfg, tokens: int) -> float:
    """2 · (resident weights a token multiplies + its k experts) · tokens, plus attention (QK and PV)."""
    embedding = model.model.embed_tokens.weight.numel()
    dense = sum(p.numel() for p in model.parameters()) - embedding
    experts = cfg.top_k * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    attention_layers = sum(1 for t in cfg.layer_types if t != "linear_attention")
    seen = sum(min(p + 1, cfg.indexer_budget + cfg.indexer_compress_ratio) for p in range(tokens))
    attention = attention_layers * 4 * seen * cfg.num_heads * cfg.head_dim
    return 2.0 * (dense + experts) * tokens + attention


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=25600)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--budget-gib", type=float, default=32.0)
    ap.add_argument(
        "--fused", action=argparse.BooleanOptionalAction, default=True,
        help="the fused kernels and projections (common/kernels; --no-fused: torch ops)",
    )  # fmt: skip
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--profile", type=Path, default=None, help="a torch profile of the prompt again")
    ap.add_argument(
        "--layer-major-tokens", type=int, default=LAYER_MAJOR_TOKENS,
        help="groups of this many tokens, each chunk of a group through a layer before the next layer (each "
        "layer's experts streamed once a group); at most --chunk: chunk by chunk",
    )  # fmt: skip
    ap.add_argument(
        "--expert-format", choices=["int4", "nvfp4", "mxfp4"], default="int4",
        help="the host store's format (random codes); not int4: the result's name says it",
    )  # fmt: skip
    args = ap.parse_args()

    use_expandable_segments()  # before CUDA starts: under the budget's cap, fixed segments thrash
    tflops = measure_tflops()
    flash = build_flashnext(
        args.layers, args.budget_gib, 1, args.prompt + 16, args.prompt, fused=args.fused,
        prefill_chunk=args.chunk, layer_major_tokens=args.layer_major_tokens,
        expert_format=args.expert_format,
    )  # fmt: skip
    runner, provider, cfg = flash.runner, flash.provider, flash.cfg
    warm_prefill(flash, {min(args.chunk, args.prompt), args.prompt % args.chunk})
    progress("warm-up prefill done")
    prompt = torch.randint(3, cfg.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(1))
    seq = runner.new_sequence()
    before = provider.traffic()
    torch.cuda.synchronize()
    start = time.perf_counter()
    layer_major = args.chunk < args.layer_major_tokens and args.chunk < args.prompt

    def prefill(seq) -> int:
        """The prompt as the engine runs it → its first token (the host waits for it)."""
        if layer_major:
            logits = runner.prefill_groups(seq, prompt.tolist(), args.chunk, args.layer_major_tokens)
        else:
            for at in range(0, args.prompt, args.chunk):
                logits = runner.forward([seq], [prompt[at : at + args.chunk].tolist()])
        return int(logits.argmax(-1))

    prefill(seq)
    ttft = time.perf_counter() - start
    progress(f"prompt prefilled: TTFT {ttft:.2f} s")
    after = provider.traffic()
    streamed = (
        sum(after.arena_bytes) - sum(before.arena_bytes) + sum(after.cache_bytes) - sum(before.cache_bytes)
    )
    flops = prefill_flops(flash.model, cfg, args.prompt)
    t_limit = max(streamed / (flash.pcie_gbps * 1e9), flops / (tflops * 1e12))
    result = {
        "limit_ratio": t_limit / ttft,
        "pcie_gbps": flash.pcie_gbps,
        "tflops": tflops,
        "ttft_s": ttft,  # after a warm-up prefill of the same chunk lengths (no JIT in it)
        "prefill_tok_per_s": args.prompt / ttft,
        "streamed_bytes": streamed,
        "flops": flops,
        "prompt": args.prompt,
        "chunk": args.chunk,
        "cache_slots": flash.slots,
        "max_memory_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
        "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
        "budget_gib": args.budget_gib,
        "layers": args.layers,
        "fused": args.fused,
        "layer_major_tokens": args.layer_major_tokens if layer_major else 0,
        "build_s": flash.build_s,
        "expert_format": args.expert_format,
        "expert_bytes": flash.store.expert_bytes,
    }
    if args.profile is not None:  # the whole prompt again, on a fresh sequence, after the timed one
        runner.release(seq)
        write_profile(lambda: prefill(runner.new_sequence()), args.profile)
    name = "prefill-128k" if args.prompt >= 131072 else "prefill-25k" if args.prompt == 25600 else "prefill"
    name += "-one-pass" if args.chunk >= args.prompt else "" if layer_major else "-chunk-major"
    name += "" if args.expert_format == "int4" else f"-{args.expert_format}"
    print(write_result(name, result, args.out))
    for key, value in result.items():
        print(f"{key:>24}: {value:.4g}" if isinstance(value, float) else f"{key:>24}: {value}")


if __name__ == "__main__":
    main()
