"""decode-1 / decode-8: flashnext (qwen4_exp) with int4 experts in mapped host memory, a VRAM expert cache
sized so the process stays under a device-memory budget, synthetic-zipf routing replay, one request or
`--lanes N` requests decoded together (they share the prompt: its state is prefilled once and copied).

    python -m bench.decode_offload --budget-gib 32 --prompt 2048 --decode 512 [--lanes 8] [--out DIR]

The model and its store: bench/flashnext.py.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.common import progress, step_state_bytes, step_weight_bytes, write_profile, write_result
from bench.flashnext import GIB, build_flashnext, warm_prefill
from common.config import DEFAULT_LOOKAHEAD, resolve_lookahead
from common.engine.decode_pipeline import DecodePipeline
from common.engine.runner import ModelRunner
from common.kernels.config import KERNELS, KernelConfig
from common.model.fused_kernels import configure_kernels


def profile_steps(runner: ModelRunner, seqs: list, tokens: list[int], path: Path, steps: int = 4) -> None:
    """Op tables (by device time and by host time) of `steps` decode steps: where a step's time goes."""
    write_profile(lambda: greedy_steps(DecodePipeline(runner), seqs, tokens, steps), path)


def greedy_steps(pipe: DecodePipeline, seqs: list, tokens: list[int], steps: int) -> list[int]:
    """`steps` greedy decode steps over every lane from `tokens`, pipelined as the decode worker's
    (`DecodePipeline.depth`); the lanes' last tokens, once every step has landed."""
    pipe.seed(seqs, tokens)
    for _ in range(steps):
        if len(pipe.launched) == pipe.depth:
            pipe.land()
        pipe.launch(seqs, seqs, lambda logits: logits.argmax(dim=-1))
    while pipe.launched:
        tokens = pipe.land().tokens
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--lanes", type=int, default=1, help="requests decoded together (decode-1, decode-8)")
    ap.add_argument("--budget-gib", type=float, default=32.0)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=64)
    ap.add_argument("--policy", default="lfu-admit")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--eager", action="store_true", help="run decode passes op by op (no CUDA graphs)")
    ap.add_argument(
        "--all-fit", action="store_true", help="decode-allfit: a slot for every expert, loaded up front"
    )
    ap.add_argument(
        "--fused", action=argparse.BooleanOptionalAction, default=True,
        help="the fused kernels and projections (common/kernels; --no-fused: torch ops)",
    )  # fmt: skip
    ap.add_argument("--profile", type=Path, default=None, help="write a torch profile of 4 steady steps here")
    ap.add_argument(
        "--lend", action="store_true", help="lend the prefill arena's second buffer to the cache (E slots)"
    )
    ap.add_argument(
        "--max-context", type=int, default=None,
        help="tokens of KV pool a lane (default: the prompt and the decode): a served --max-context",
    )  # fmt: skip
    ap.add_argument(
        "--lend-kv", action="store_true", help="the KV pool's idle pages lent to the cache as slots"
    )
    ap.add_argument(
        "--embeddings-on-host", action="store_true", help="the token embedding in host memory (more slots)"
    )
    ap.add_argument(
        "--resident-dtype", choices=["fp8"], default=None, help="token mixers' projections in fp8"
    )
    ap.add_argument(
        "--lookahead", type=int, default=None,
        help="each MoE layer guesses the next one's top-N experts a token and copies them ahead while they "
        f"are used (0: off; default {DEFAULT_LOOKAHEAD}, the engine's on CUDA with a cache)",
    )  # fmt: skip
    ap.add_argument(
        "--routing", choices=["synthetic-zipf", "model"], default="synthetic-zipf",
        help="the trace replay (the benchmark's), or the random-weight routers' own choices",
    )  # fmt: skip
    ap.add_argument(
        "--ablate", action="store_true",
        help="then decode again from the prompt with each decode kernel (and lookahead) switched alone "
        "(DECODE_SWITCHES): "
        "decode-N-ablate.json (one more lane's state held: slots a little fewer than the plain run's)",
    )  # fmt: skip
    ap.add_argument(
        "--switches", nargs="+", type=variant, default=None,
        help="with --ablate: only these variants (after the defaults); A+B flips two switches together",
    )  # fmt: skip
    ap.add_argument(
        "--split-lanes", type=int, default=None,
        help="lanes from which a recorded pass runs as two groups (KernelConfig.split_lanes; default 8)",
    )  # fmt: skip
    ap.add_argument(
        "--expert-format", choices=["int4", "nvfp4", "mxfp4"], default="int4",
        help="the host store's format (random codes); not int4: the result's name says it",
    )  # fmt: skip
    args = ap.parse_args()
    lookahead = resolve_lookahead("", True, args.lookahead, "cuda")  # the engine's rule: an expert cache

    lanes = args.lanes + int(args.ablate)  # --ablate: the prompt's state held beside the lanes
    switches = args.switches or DECODE_SWITCHES
    runs = 1 + (2 + len(switches)) * int(args.ablate)  # the routing trace covers every run's steps
    flash = build_flashnext(
        args.layers,
        args.budget_gib,
        lanes,
        args.max_context or args.prompt + args.decode + 16 + 8,
        args.prompt + args.decode * args.lanes * runs,
        args.policy,
        args.eager,
        args.fused,
        args.all_fit,
        prefill_chunk=args.prompt,
        lend=args.lend,  # the prompt is prefilled in one pass
        embeddings_on_host=args.embeddings_on_host,
        resident_dtype=args.resident_dtype,
        lend_kv=args.lend_kv,
        lookahead=lookahead,
        routing=args.routing,
        expert_format=args.expert_format,
    )  # fmt: skip  (the default context: + 16 + 8 for the profiled steps)
    model, cfg, store, runner, provider = flash.model, flash.cfg, flash.store, flash.runner, flash.provider
    pcie, hbm, slots, build_s = flash.pcie_gbps, flash.hbm_gbps, flash.slots, flash.build_s
    if args.split_lanes is not None:  # before the runner records any pass
        configure_kernels(model, replace(model.kernels, split_lanes=args.split_lanes))

    prompt = torch.randint(
        3, cfg.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    built_gib = torch.cuda.memory_reserved() / GIB
    warm_prefill(flash, {args.prompt})
    progress("warm-up prefill done")
    seq = runner.new_sequence()
    t0 = time.perf_counter()
    token = int(runner.forward([seq], [prompt]).argmax(-1))
    torch.cuda.synchronize()
    ttft = time.perf_counter() - t0
    prefill_peak_gib = torch.cuda.max_memory_reserved() / GIB
    pristine = runner.pool.fork(seq) if args.ablate else None  # the prompt's state, for the ablations
    # the other lanes share the prompt: copies of its state, not more prefills (routing comes from the trace)
    seqs = [seq] + [runner.pool.fork(seq) for _ in range(args.lanes - 1)]
    progress("prompt prefilled; decoding")
    run = decode(runner, provider, seqs, [token] * args.lanes, args.decode, args.warmup)
    progress("decode done")
    tokens = run.pop("tokens")
    if args.profile is not None:
        profile_steps(runner, seqs, tokens, args.profile)
    steps = args.decode - args.warmup
    resident = step_weight_bytes(model, args.lanes)  # the embedding: the rows a step gathers
    # the timed steps' mean context: the prompt, then a token a step from the first decoded one on
    context = args.prompt + 1 + (args.warmup + args.decode - 1) / 2
    state = step_state_bytes(
        runner.pool, args.lanes, context, cfg.indexer_budget, cfg.indexer_compress_ratio
    )  # K/V, indexer keys and recurrent states read a step
    used = (run["hits"] + run["misses"]) / steps * store.expert_bytes  # experts read per step
    if args.all_fit:  # nothing is resolved, so nothing counted: each layer reads its lanes' experts
        used = len(cfg.moe_layers) * min(cfg.num_experts, args.lanes * cfg.top_k) * store.expert_bytes
    h2d = (run["cache_bytes"] + (run["prefetches"] + run["bypasses"]) * store.expert_bytes) / steps
    # the limit counts the bytes the step needed: a lookahead's guesses that no step used are waste, not limit
    needed = (run["cache_bytes"] + (run["bypasses"] + run["prefetch_hits"]) * store.expert_bytes) / steps
    t_limit = max(needed / (pcie * 1e9), (resident + used + state) / (hbm * 1e9))  # per step
    step_s = run["seconds"] / steps
    result = {
        "limit_ratio": t_limit / step_s,
        "pcie_gbps": pcie,
        "hbm_gbps": hbm,
        "lanes": args.lanes,
        "tok_per_s": 1 / step_s,
        "aggregate_tok_per_s": args.lanes / step_s,
        "ttft_s": ttft,  # after a warm-up prefill of the same chunk lengths (no JIT in it)
        "hit_rate": 1.0 if args.all_fit else run["hits"] / max(run["hits"] + run["misses"], 1),
        "misses_per_token": run["misses"] / steps / args.lanes,
        "bypasses_per_token": run["bypasses"] / steps / args.lanes,
        "h2d_bytes_per_token": h2d / args.lanes,  # with --lookahead: its copies, used or not, too
        "h2d_needed_bytes_per_token": needed / args.lanes,  # the limit's: misses and guesses then used
        "lookahead": lookahead,
        "decode_groups": runner.graphs.groups(args.lanes) if runner.graphs is not None else 1,
        "routing": args.routing,
        "prefetches_per_token": run["prefetches"] / steps / args.lanes,
        "prefetch_hits_per_token": run["prefetch_hits"] / steps / args.lanes,  # guesses a step then used
        "cache_slots": slots + provider.tables.lent,  # with --lend / --lend-kv: the lent slots too
        "lent_slots": provider.tables.lent,
        "max_context": args.max_context,
        "lend_kv": args.lend_kv,
        "aliased_gib": flash.aliased_bytes / GIB,  # --lend-kv: the pools' memory, not in memory_reserved
        "embeddings_on_host": args.embeddings_on_host,
        "resident_dtype": args.resident_dtype,
        "expert_bytes": store.expert_bytes,
        "expert_format": args.expert_format,
        "bits_per_weight": store.expert_bytes * 8 / (3 * cfg.hidden_size * cfg.moe_intermediate_size),
        "hbm_bytes_a_step": resident + used + state,  # the limit's: weights, experts, per-sequence state
        "state_bytes_a_step": state,  # of which K/V, indexer keys and recurrent states (read)
        "max_memory_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
        "reserved_after_build_gib": built_gib,  # weights, pools, cache: before any pass
        "max_reserved_after_prefill_gib": prefill_peak_gib,  # the peak before the first decode step
        "budget_gib": None if args.all_fit else args.budget_gib,  # all-fit: what every expert takes
        "layers": args.layers,
        "policy": args.policy,
        "build_s": build_s,
        "cuda_graphs": not args.eager,
        "fused_decode": args.fused,
        "all_fit": args.all_fit,
    }
    name = "decode-allfit" if args.all_fit else f"decode-{args.lanes}" + ("-lending" if args.lend else "")
    name += f"-context-{args.max_context}" if args.max_context else ""
    name += "-lend-kv" if args.lend_kv else ""
    name += "-host-embeddings" if args.embeddings_on_host else ""
    name += f"-resident-{args.resident_dtype}" if args.resident_dtype else ""
    name += "" if args.expert_format == "int4" else f"-{args.expert_format}"
    name += "-routing-model" if args.routing == "model" else ""
    name += "" if args.lookahead is None else f"-lookahead-{args.lookahead}"  # the default: no suffix
    name += "" if args.split_lanes is None else f"-split-{args.split_lanes}"
    name += ("" if args.fused else "-torch-ops") + ("-eager" if args.eager else "")  # a variant: its own file
    if args.ablate:
        for s in seqs:  # their slots go to the ablations' lanes
            runner.release(s)
        result["ablations"] = ablations(runner, provider, pristine, token, args)
        name += "-ablate"
    print(write_result(name, result, args.out))
    for k, v in result.items():
        print(f"{k:>24}: {v:.4g}" if isinstance(v, float) else f"{k:>24}: {v}")


def kernel_variants() -> dict[str, dict[str, object]]:
    """The variants that are kernel configurations: name → the KernelConfig fields they change."""
    resident = KERNELS.int4_resident
    one = resident[1]
    triton_one = replace(one, native_rows=0, native_down_warps=0)  # Triton's words form, not CUDA C's
    return {
        "no-select-kernel": {"select_kernel": False},
        "no-project-kernel": {"project_kernel": False},
        "no-mix-up-kernel": {"mix_up_kernel": False},
        "no-shared-kernel": {"shared_kernel": False},
        "no-lookahead": {"lookahead": False},
        "int4-bytes": {"int4_resident": KERNELS.int4_decode},
        "int4-words": {"int4_decode": resident},
        "no-defer-inject": {"defer_inject": False},
        "no-gemv": {"gemv": False},
        "cublas-large": {"large_one_row": False},
        "no-fold": {"fold_sums": False},
        "fp8-narrow": {"fp8_large_one_row": False},
        "gemv-no-pdl": {"gemv_pdl": False},
        "hold-mixer-launch": {"hold_mixer_launch": True},
        "no-hold-mixer-launch": {"hold_mixer_launch": False},
        "no-int4-native": {"int4_resident": {**resident, 1: triton_one}},
        "no-int4-native-mma": {"int4_resident": {**resident, 1: replace(one, native_mma=False)}},
        "no-int4-native-down-mma": {"int4_resident": {**resident, 1: replace(one, native_down_mma=False)}},
        "no-gemv-native": {"gemv_native": False},
        "no-moe-dispatch": {"moe_dispatch": False},
        "select-search": {"select_rank": False},
        "no-qsa-prologue": {"prologue_kernel": False},
        "no-conv-epilogue": {"conv_epilogue": False},
        "no-hc-split-rank": {"mix_up_split_rank": False},
        "no-pdl": {"pdl": False},
        "pdl-exit-trigger": {"pdl_early_trigger": False},
        "no-tail-trigger-first": {"pdl_start_trigger": False},
        "qsa-splits-16": {"attention_programs": 32},
        "qsa-splits-32": {"attention_programs": 64},
        "qsa-splits-64": {"attention_programs": 128},
        "no-combine-shared": {"combine_shared": False},
        "no-groups": {"split_lanes": 0},
        "no-pipeline": {"pipeline_depth": 1},
    }


DECODE_SWITCHES = (
    "no-select-kernel", "no-project-kernel", "no-mix-up-kernel", "no-shared-kernel", "no-combine-shared",
    "no-lookahead", "no-groups", "int4-bytes", "int4-words", "no-pdl",
    "no-defer-inject", "no-pipeline", "no-gemv", "cublas-large", "no-fold",
    "fp8-narrow", "gemv-no-pdl", "pdl-exit-trigger", "hold-mixer-launch", "no-hold-mixer-launch",
    "no-int4-native", "no-int4-native-mma", "no-int4-native-down-mma", "no-gemv-native",
    "no-moe-dispatch", "select-search", "no-qsa-prologue", "no-conv-epilogue",
    "qsa-splits-16", "qsa-splits-32", "qsa-splits-64", "no-tail-trigger-first", "no-hc-split-rank",
)  # fmt: skip
"""The variants of `--ablate`, each one change from the defaults (`kernel_variants`)."""


def variant(name: str) -> str:
    """An `--switches` variant: one of DECODE_SWITCHES, or several joined by '+' (changed together)."""
    unknown = [part for part in name.split("+") if part not in DECODE_SWITCHES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown switch {unknown[0]!r}: one of {', '.join(DECODE_SWITCHES)}"
        )
    return name


def variant_config(base: KernelConfig, name: str) -> KernelConfig:
    """`base` with the parts of variant `name` (parts joined by '+') applied."""
    table = kernel_variants()
    changes = [table[part] for part in name.split("+")]
    return replace(base, **{field: value for change in changes for field, value in change.items()})


def ablations(runner: ModelRunner, provider, pristine, token: int, args) -> dict:
    """The defaults, then each variant of `--switches` (a variant of `kernel_variants`, or several joined by
    '+'): the same decode from the prompt's state (fresh copies of `pristine` each
    time; the cache carries over and the warm-up steps settle it), the model handed the variant's kernel
    configuration and its graphs recorded again. Per variant: tok/s per request and aggregate, hit rate;
    with --profile PATH, a profile of its steps too (PATH-NAME)."""
    out = {}
    model = runner.model
    base = getattr(model, "kernels", KERNELS)
    for name in ("defaults", *(args.switches or DECODE_SWITCHES)):
        configure_kernels(model, base if name == "defaults" else variant_config(base, name))
        if runner.graphs is not None:
            runner.graphs.forget()
        seqs = [runner.pool.fork(pristine) for _ in range(args.lanes)]
        run = decode(runner, provider, seqs, [token] * args.lanes, args.decode, args.warmup)
        seconds = run["seconds"] / (args.decode - args.warmup)
        hits = run["hits"] / max(run["hits"] + run["misses"], 1)
        out[name] = {"tok_per_s": 1 / seconds, "aggregate_tok_per_s": args.lanes / seconds, "hit_rate": hits}
        progress(f"{name}: {1 / seconds:.2f} tok/s a request, hit {hits:.3f}")
        if args.profile is not None:  # each variant's steps beside the plain run's: PATH-NAME
            profile_steps(runner, seqs, run["tokens"], args.profile.with_name(f"{args.profile.name}-{name}"))
        for s in seqs:
            runner.release(s)
    configure_kernels(model, base)
    return out


def decode(runner: ModelRunner, provider, seqs: list, tokens: list[int], steps: int, warmup: int) -> dict:
    """Greedy decode steps over every lane; totals of the steps after `warmup`: seconds, cache counters,
    bytes copied into the cache; and the lanes' last tokens."""
    pipe = DecodePipeline(runner)
    tokens = greedy_steps(pipe, seqs, tokens, warmup)
    torch.cuda.synchronize()
    marks = _counts(provider) | {"seconds": time.perf_counter()}
    tokens = greedy_steps(pipe, seqs, tokens, steps - warmup)
    torch.cuda.synchronize()
    end = _counts(provider) | {"seconds": time.perf_counter()}
    return {k: end[k] - marks[k] for k in end} | {"tokens": tokens}


def _counts(provider) -> dict:
    counters = {k: int(v.sum()) for k, v in provider.tables.counters.items()}
    return counters | {"cache_bytes": sum(provider.traffic().cache_bytes)}


if __name__ == "__main__":
    main()
