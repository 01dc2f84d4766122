"""Command-line flags shared by the prefill and decode workers (both must be started with the same ones)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from collections.abc import Callable

from common.config import (
    DEFAULT_LOOKAHEAD,
    GRAMMAR_MAX_BYTES,
    GRAMMAR_TIMEOUT_S,
    LAYER_MAJOR_TOKENS,
    PREFILL_CHUNK,
    WorkerConfig,
    check_lending,
    resolve_lookahead,
)
from common.experts.cache_tables import DEFAULT_POLICY, POLICIES
from common.experts.formats import PACKED_FORMATS


def add_config_args(
    parser: argparse.ArgumentParser, model_required: bool = True, device_here: bool = True
) -> None:
    """The model and memory flags (WorkerConfig's), shared by the workers and `spillway serve`.

    `device_here=False`: --device is checked for its form only (`device_name`), not against this machine's
    devices (`device_arg`): `serve --ray` places the workers on other machines."""
    if model_required:
        parser.add_argument("--model", required=True, help="model directory or converted artifact")
    else:
        parser.add_argument(
            "--model", default=None, help="model directory (default: the embedded tiny model)"
        )
    parser.add_argument(
        "--device",
        type=device_arg if device_here else device_name,
        default="cpu",
        help="cpu | cuda | cuda:N | auto",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="activations and resident weights (default auto: bfloat16 on CUDA, float32 on the CPU)",
    )
    parser.add_argument(
        "--max-running", type=int_at_least(1), default=8, help="requests decoded together (lanes)"
    )
    parser.add_argument(
        "--max-context", type=int_at_least(2), default=4096, help="most tokens of one request"
    )
    parser.add_argument("--expert-cache", default=None, metavar="SLOTS|FRACTION|all")
    parser.add_argument("--cache-policy", default=DEFAULT_POLICY, choices=POLICIES)
    parser.add_argument(
        "--expert-format",
        default="auto",
        choices=["auto", *PACKED_FORMATS],
        help="offloaded experts' runtime format (default auto: with --vram-budget the first of bf16, fp8, "
        "int4 whose cache holds every expert, else the one that caches the most, else bf16; a published "
        "checkpoint's experts keep their own bits)",
    )
    add_prefill_args(parser)
    parser.add_argument("--replay-routing", default=None, metavar="FILE|synthetic-zipf:...")
    parser.add_argument(
        "--vram-budget",
        type=size_arg,
        default=None,
        metavar="SIZE",
        help="cap on the device memory of the services (32GiB, 500MiB, bytes): the expert cache gets what "
        "the memory plan leaves (see `spillway plan`); implies offloaded experts",
    )
    add_placement_args(parser)
    add_fused_kernels_arg(parser)
    parser.add_argument(
        "--eager", action="store_true", help="run decode passes op by op, not as recorded CUDA graphs"
    )
    parser.add_argument(
        "--lend-kv",
        action="store_true",
        help="lend the KV pool's idle pages to the expert cache as slots, taken back as contexts grow",
    )
    parser.add_argument(
        "--lend-arena",
        action="store_true",
        help="hold prefill's arena in decode's expert pool, lent to the cache as 2E+1 slots between prefills",
    )
    add_lookahead_arg(parser)
    add_grammar_args(parser)
    parser.add_argument(
        "--threads", type=int_at_least(0), default=0, help="CPU threads per worker (0: torch's default)"
    )


def add_lookahead_arg(parser: argparse.ArgumentParser) -> None:
    """--lookahead N, for serve, its workers and generate."""
    parser.add_argument(
        "--lookahead",
        type=int,
        default=None,
        metavar="N",
        help="decode: each MoE layer guesses the next one's top-N experts a token from its own input and "
        "copies the uncached ones in while it computes, while they are used (0: off; default "
        f"{DEFAULT_LOOKAHEAD} with an expert cache on CUDA, else 0; bench/README.md has the measurements)",
    )


def add_grammar_args(parser: argparse.ArgumentParser) -> None:
    """The structured outputs' budgets (WorkerConfig.grammar_max_bytes, .grammar_timeout_s), for serve and
    its workers."""
    parser.add_argument(
        "--grammar-max-bytes",
        type=size_arg,
        default=GRAMMAR_MAX_BYTES,
        metavar="SIZE",
        help="largest structured output's grammar (its JSON schema's form, 512KiB, bytes) compiled; a larger "
        "one is a 400 (default %(default)s)",
    )
    parser.add_argument(
        "--grammar-timeout",
        type=float_at_least(0.0),
        default=GRAMMAR_TIMEOUT_S,
        metavar="SECONDS",
        help="seconds a structured request waits for its grammar's compile (the others go on meanwhile) "
        "before it fails with a 400 (default %(default)s)",
    )


def add_prefill_args(parser: argparse.ArgumentParser) -> None:
    """How a prompt is cut into passes, for serve, its workers, generate and plan alike."""
    parser.add_argument(
        "--prefill-chunk",
        type=int_at_least(1),
        default=PREFILL_CHUNK,
        help="most prompt tokens per prefill pass",
    )
    parser.add_argument(
        "--layer-major-tokens",
        type=int_at_least(0),
        default=LAYER_MAJOR_TOKENS,
        help="most prompt tokens whose chunks go through each layer together (each layer's experts "
        "streamed once for them; their residual streams held meanwhile); at most --prefill-chunk: chunk "
        "by chunk",
    )


def add_fused_kernels_arg(parser: argparse.ArgumentParser) -> None:
    """--fused-kernels / --no-fused-kernels, for serve, its workers and plan (None: on CUDA)."""
    parser.add_argument(
        "--fused-kernels",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the fused Triton kernels and projections (default: on CUDA; --no-fused-kernels: torch ops)",
    )


def add_placement_args(parser: argparse.ArgumentParser) -> None:
    """Where state lives and in what form, for serve, generate and plan alike: the K/V dtype, the token
    embedding, the resident projections' dtype."""
    parser.add_argument(
        "--kv-dtype", default="auto", choices=["auto", "fp8_e4m3"], help="K/V pages: the model dtype or fp8"
    )
    parser.add_argument(
        "--embeddings-on-host",
        action="store_true",
        help="keep the token embedding in host memory (its VRAM goes to the expert cache)",
    )
    parser.add_argument(
        "--resident-dtype",
        choices=["fp8"],
        default=None,
        help="keep the token mixers' projections in fp8 (per row and 128 inputs scaled): more room for the "
        "expert cache, fewer bytes a decode step reads (default: the model dtype)",
    )


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    """A worker's flags: WorkerConfig's and its socket addresses."""
    add_config_args(parser)
    parser.add_argument("--inbox", required=True, help="this worker's PULL address")
    parser.add_argument("--router", required=True, help="the router's inbox address")
    parser.add_argument("--peer", required=True, help="the other worker's inbox address")
    parser.add_argument(
        "--encoder",
        default="",
        help="the vision encoder's inbox address (prefill: where it gives the encoder's rows back; none: the "
        "model's prompts carry no images)",
    )
    parser.add_argument(
        "--name",
        default=None,
        help="the service name it announces to the router (default: its role; the router's pairs after the "
        "first: prefill-N, decode-N)",
    )
    parser.add_argument("--metrics-port", type=int_at_least(0), default=0, help="Prometheus port (0: none)")
    parser.add_argument(
        "--stall-timeout",
        type=float_at_least(0.0),
        default=120.0,
        help="seconds the worker's loop may stall once ready before the process takes itself as hung and "
        "exits, to be restarted (0: never; default %(default)s)",
    )
    parser.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop once the process that started this one is gone (a supervisor that cannot stop its "
        "children when it dies: the Ray launcher's pair hosts)",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="interface the metrics port binds (0.0.0.0 in a container, for Prometheus; default %(default)s)",
    )


def worker_parser(prog: str, description: str | None = None) -> argparse.ArgumentParser:
    """A worker's command line (`python -m services.decode`, `... services.prefill`)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_worker_args(parser)
    return parser


def worker_config(args: argparse.Namespace, model_dir: str | None = None) -> WorkerConfig:
    """The WorkerConfig the flags of add_config_args give (`model_dir` in place of a missing --model);
    ValueError for lending flags that cannot hold."""
    cached = args.expert_cache is not None or args.vram_budget is not None  # a budget implies a cache
    check_lending(str(model_dir or args.model), cached, args.lend_kv, args.lend_arena, decode_worker=True)
    resolve_lookahead(str(model_dir or args.model), cached, args.lookahead, args.device)  # raises early
    cfg = WorkerConfig(
        model_dir=model_dir or args.model,
        device=args.device,
        dtype=args.dtype,
        max_running=args.max_running,
        max_context=args.max_context,
        expert_cache=args.expert_cache,
        cache_policy=args.cache_policy,
        expert_format="bf16" if args.expert_format == "auto" else args.expert_format,
        prefill_chunk=args.prefill_chunk,
        layer_major_tokens=args.layer_major_tokens,
        replay_routing=args.replay_routing,
        vram_budget=args.vram_budget,
        kv_dtype=None if args.kv_dtype == "auto" else args.kv_dtype,
        cuda_graphs=not args.eager,
        embeddings_on_host=args.embeddings_on_host,
        fused_kernels=args.fused_kernels,
        resident_dtype=args.resident_dtype,
        lend_kv=args.lend_kv,
        lend_arena=args.lend_arena,
        lookahead=args.lookahead,
        grammar_max_bytes=args.grammar_max_bytes,
        grammar_timeout_s=args.grammar_timeout,
    )
    if args.expert_format == "auto" and cfg.vram_budget is not None:
        cfg = dataclasses.replace(cfg, expert_format=auto_expert_format(cfg))
    return cfg


def auto_expert_format(cfg: WorkerConfig) -> str:
    """`--expert-format auto` under `cfg.vram_budget` (memory_plan.auto_plan over serve's memory plans;
    planned on CUDA where the device is `auto`: a Ray cluster's nodes)."""
    from common.engine.memory_plan import auto_plan, worker_plan

    on = cfg if cfg.device != "auto" else dataclasses.replace(cfg, device="cuda")
    return auto_plan(lambda fmt: worker_plan(dataclasses.replace(on, expert_format=fmt))).expert_format


def parsed_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> WorkerConfig:
    """A worker's config from its flags; flags that cannot hold end the process as argparse does (exit 2)."""
    try:
        return worker_config(args)
    except ValueError as exc:
        parser.error(str(exc))


def config_argv(cfg: WorkerConfig) -> list[str]:
    """The flags that give `cfg` back through worker_config (how the launcher starts both workers alike)."""
    argv = ["--model", cfg.model_dir, "--device", cfg.device, "--dtype", cfg.dtype]
    argv += ["--max-running", str(cfg.max_running), "--max-context", str(cfg.max_context)]
    argv += ["--cache-policy", cfg.cache_policy, "--expert-format", cfg.expert_format]
    argv += ["--prefill-chunk", str(cfg.prefill_chunk), "--layer-major-tokens", str(cfg.layer_major_tokens)]
    argv += ["--kv-dtype", cfg.kv_dtype or "auto"]
    argv += ["--grammar-max-bytes", str(cfg.grammar_max_bytes)]
    argv += ["--grammar-timeout", str(cfg.grammar_timeout_s)]
    optional = {"--expert-cache": cfg.expert_cache, "--replay-routing": cfg.replay_routing}
    optional["--vram-budget"] = None if cfg.vram_budget is None else str(cfg.vram_budget)
    argv += [] if cfg.cuda_graphs else ["--eager"]
    argv += ["--embeddings-on-host"] if cfg.embeddings_on_host else []
    argv += ["--lend-kv"] if cfg.lend_kv else []
    argv += ["--lend-arena"] if cfg.lend_arena else []
    argv += [] if cfg.lookahead is None else ["--lookahead", str(cfg.lookahead)]
    argv += ["--resident-dtype", cfg.resident_dtype] if cfg.resident_dtype else []
    if cfg.fused_kernels is not None:
        argv += ["--fused-kernels" if cfg.fused_kernels else "--no-fused-kernels"]
    for flag, value in optional.items():
        if value is not None:
            argv += [flag, value]
    return argv


def int_at_least(low: int) -> Callable[[str], int]:
    """argparse type of an integer that is at least `low` (a count, a length)."""
    return _at_least(low, int, "an integer")


def float_at_least(low: float) -> Callable[[str], float]:
    """argparse type of a number that is at least `low` (a duration)."""
    return _at_least(low, float, "a number")


def _at_least(low, convert, what: str):
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not value >= low:  # (NaN too)
            raise argparse.ArgumentTypeError(f"{value} is below {low}")
        if not math.isfinite(value):  # 0 says "never" where a flag allows it
            raise argparse.ArgumentTypeError(f"{value} is not finite")
        return value

    return parse


def device_name(text: str) -> str:
    """argparse type of a device's name (`cpu`, `cuda`, `cuda:N`, `auto`), whatever this machine has."""
    if text in ("cpu", "cuda", "auto") or re.fullmatch(r"cuda:\d+", text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not a device: cpu, cuda, cuda:N or auto")


def device_arg(text: str) -> str:
    """argparse type of a device this machine has: `cpu`, `cuda` or `cuda:N`, or `auto`: `cuda` where one is
    available, else `cpu` (a container image that runs with or without a GPU)."""
    import torch

    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return text
    if device.type != "cuda":
        raise argparse.ArgumentTypeError(f"{text!r}: the devices are cpu, cuda and cuda:N")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: no CUDA device is available here")
    if device.index is not None and device.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise argparse.ArgumentTypeError(
            f"{text!r}: there are {count} CUDA devices (cuda:0 to cuda:{count - 1})"
        )
    return text


def size_arg(text: str) -> int:
    """argparse type of a byte size (`32GiB`, `500MiB`, `4096`): see
    `common.engine.memory_plan.parse_size`."""
    from common.engine.memory_plan import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
