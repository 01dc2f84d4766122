"""The `spillway` command."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import cast

import jinja2

from common.experts.cache_tables import DEFAULT_POLICY, POLICIES
from common.experts.formats import PACKED_FORMATS
from services.logs import add_log_args
from services.worker_args import (
    add_config_args,
    add_fused_kernels_arg,
    add_lookahead_arg,
    add_placement_args,
    add_prefill_args,
    device_arg,
    device_name,
    float_at_least,
    int_at_least,
    size_arg,
)

DTYPES = ("float32", "bfloat16", "float16")
GENERATE_LANES, GENERATE_CONTEXT = 8, 4096
"""The offline engine's lanes and context (`spillway generate`; its memory plan is for these)."""
DEFAULT_SERVE_CACHE = "0.5"
"""`serve`'s expert cache for the embedded model when neither --expert-cache nor --vram-budget is given:
half of each layer's experts in the cache, the rest read through from host memory (as docker-compose's
default), so that the cache's metrics and panels have data from the first request."""


def _replace_destination(out: str, force: bool, source: str | None = None) -> None:
    """A writing command's destination directory: refused when it exists and is not empty, unless `force`,
    which removes it (never the `source`)."""
    path = Path(out)
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return
    if not force:
        raise ValueError(f"{out} exists and is not empty; --force replaces it")
    if source is not None and path.resolve() == Path(source).resolve():
        raise ValueError(f"{out} is the source; --force does not remove it")
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()


def _make_model(args: argparse.Namespace) -> int:
    from common.model.synthetic.checkpoint import make_model
    from common.model.synthetic.config import model_config, parse_overrides

    overrides = parse_overrides(args.set)
    model_config(args.preset, args.arch, overrides)  # a bad preset, arch or override: before any removal
    _replace_destination(args.out, args.force)
    out = make_model(
        args.out,
        preset=args.preset,
        arch=args.arch,
        overrides=overrides,
        seed=args.seed,
        quantize=args.quantize,
    )
    print(f"wrote {args.preset} ({args.arch or 'default arch'}) to {out}")
    return 0


def _keys(args: argparse.Namespace) -> int:
    from common.ipc.keys import LAUNCHER, write_keys

    paths = write_keys(args.out, [*args.names, LAUNCHER])
    print(f"wrote the control-plane keys of {', '.join(paths)} to {args.out}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from common.config import WorkerConfig
    from common.engine.engine import Engine
    from common.engine.memory_plan import cap_allocator, use_expandable_segments
    from common.model.defaults import default_model_dir
    from common.protocol import SamplingParams

    model_dir = Path(args.model) if args.model else default_model_dir()
    if args.record_routing and not Path(args.record_routing).absolute().parent.is_dir():
        raise ValueError(f"--record-routing {args.record_routing}: its directory does not exist")
    expert_cache = args.expert_cache
    if args.vram_budget is not None:
        use_expandable_segments()  # before CUDA starts: the budget is a cap (cap_allocator's docstring)
        expert_cache = _generate_cache(args, model_dir)
        cap_allocator(args.vram_budget, args.device)
    cfg = WorkerConfig(
        model_dir=str(model_dir),
        device=args.device,
        dtype=args.dtype,
        max_running=GENERATE_LANES,
        max_context=GENERATE_CONTEXT,
        expert_cache=expert_cache,
        cache_policy=args.cache_policy,
        expert_format=args.expert_format,
        prefill_chunk=args.prefill_chunk,
        layer_major_tokens=args.layer_major_tokens,
        replay_routing=args.replay_routing,
        kv_dtype=None if args.kv_dtype == "auto" else args.kv_dtype,
        embeddings_on_host=args.embeddings_on_host,
        resident_dtype=args.resident_dtype,
        lend_arena=args.lend_arena,
        lookahead=args.lookahead,
        speculative=args.speculative,
        num_draft=args.num_draft,
        record_routing=args.record_routing is not None,
        pin_experts=args.pin_experts,
    )
    engine = Engine(cfg)
    tok = engine.tokenizer
    images = None
    if args.image:
        prompt_ids, images = _image_chat(args, engine, model_dir)
    elif args.chat is not None:
        messages = [{"role": "user", "content": args.chat}]
        prompt_ids = cast(list[int], tok.apply_chat_template(messages, tokenize=True))  # ids: tokenize
    else:
        prompt_ids = tok.encode(args.prompt)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
    )
    start = time.perf_counter()
    result = engine.generate([prompt_ids], params, [images])[0]
    elapsed = time.perf_counter() - start
    text = tok.decode(result.token_ids)
    if args.json:
        print(
            json.dumps(
                {
                    "model": str(model_dir),
                    "prompt_ids": prompt_ids,
                    "token_ids": result.token_ids,
                    "text": text,
                    "finish_reason": result.finish_reason,
                    "tok_per_s": len(result.token_ids) / elapsed,
                }
            )
        )
    else:
        print(text)
        print(
            f"[{len(result.token_ids)} tokens, {len(result.token_ids) / elapsed:.1f} tok/s, "
            f"finish: {result.finish_reason}, model: {model_dir}]",
            file=sys.stderr,
        )
    if args.record_routing:  # after the text: a failure to write it loses nothing else
        assert engine.routing_recorder is not None  # (cfg.record_routing)
        engine.routing_recorder.trace().save(args.record_routing)
    return 0


def _image_chat(args: argparse.Namespace, engine, model_dir: Path) -> tuple[list[int], tuple]:
    """`--chat` with `--image` files before its text: the prompt (each image its run of image tokens, as the
    router makes it) and what its images change in its passes (the vision tower run here)."""
    import torch

    from common.model.qwen4_exp.positions import ImageTokens, prompt_images
    from common.openai.chat_images import ImagePrompting
    from common.vision.encoder import ImageEncoder
    from common.vision.images import decode_image

    tok = engine.tokenizer
    prompting, tokens = ImagePrompting.from_model_dir(model_dir, tok), ImageTokens.from_model_dir(model_dir)
    if args.chat is None or prompting is None or tokens is None:
        raise ValueError(f"--image needs --chat and a model with a vision tower ({model_dir} has none)")
    files = [Path(path).read_bytes() for path in args.image]
    chat = [prompting.read_file(raw) for raw in files]
    content = prompting.placeholder * len(files) + args.chat
    ids = prompting.expand(
        tok.apply_chat_template([{"role": "user", "content": content}], tokenize=True), chat
    )
    encoder = ImageEncoder(model_dir, getattr(torch, args.dtype), args.device)
    encoded = encoder.encode([decode_image(raw) for raw in files])
    embeds = torch.cat([e.embeddings for e in encoded])
    grids = [e.grid for e in encoded]
    return ids, prompt_images(ids, tokens.image_token_id, embeds, grids, tokens.merge, tokens.block)


def _generate_cache(args: argparse.Namespace, model_dir: Path) -> str:
    """--vram-budget for the offline engine: the expert cache's slots from a one-process plan (printed to
    stderr); ValueError when the plan is refused."""
    from common.engine.memory_plan import DTYPES as PLAN_DTYPES
    from common.engine.memory_plan import format_plan, plan_for_dir
    from common.kernels import fused_by_default

    if args.expert_cache is not None:
        raise ValueError("give --vram-budget or --expert-cache, not both: the budget sizes the expert cache")
    plan = plan_for_dir(
        model_dir,
        expert_format=args.expert_format,
        budget_bytes=args.vram_budget,
        max_context=GENERATE_CONTEXT,
        max_running=GENERATE_LANES,
        dtype=PLAN_DTYPES[args.dtype],
        prefill_chunk=args.prefill_chunk,
        layer_major_tokens=args.layer_major_tokens,
        processes=1,
        mtp=args.speculative == "mtp",
        kv_dtype=None if args.kv_dtype == "auto" else args.kv_dtype,
        embeddings_on_host=args.embeddings_on_host,
        fused_kernels=fused_by_default(None, args.device),  # as the engine decides
        resident_dtype=args.resident_dtype,
    )
    print(format_plan(plan), file=sys.stderr)
    plan.check()
    return str(plan.cache_slots)


def _simulate(args: argparse.Namespace) -> int:
    from common.experts.simulator import format_table, simulate
    from common.experts.trace import parse_trace

    result = simulate(parse_trace(args.trace), args.capacity)
    print(json.dumps(result) if args.json else format_table(result, args.capacity))
    return 0


def _convert(args: argparse.Namespace) -> int:
    from common.experts.artifact import convert
    from common.experts.formats import get_format

    get_format(args.experts)  # an unknown format: before any removal
    _replace_destination(args.dst, args.force, source=args.src)
    convert(args.src, args.dst, args.experts)
    return 0


def _fraction(text: str) -> float:
    """`simulate --capacity`: a fraction in (0, 1], checked before the trace is built."""
    from common.experts.simulator import slots_per_layer

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is no number") from None
    try:
        slots_per_layer(value, 1)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _plan_format(name: str) -> str:
    """`plan --expert-format`: any expert format's name (a published one: a preset planned as published)."""
    from common.experts.formats import get_format

    if name == "auto":
        return name
    try:
        get_format(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name


def _plan(args: argparse.Namespace) -> int:
    """Print the memory plan of a model directory or a preset's config (nothing is loaded or started)."""
    from common.config import resolve_dtype
    from common.engine.memory_plan import (
        DTYPES,
        auto_plan,
        format_plan,
        plan_dict,
        plan_for_dir,
        plan_memory,
    )
    from common.kernels import fused_by_default

    settings = {
        "budget_bytes": args.vram_budget,
        "max_context": args.max_context,
        "max_running": args.max_running,
        "dtype": DTYPES[resolve_dtype(args.dtype, "cuda")],
        "prefill_chunk": args.prefill_chunk,
        "layer_major_tokens": args.layer_major_tokens,
        "processes": 1 if args.single_process else 2,
        "kv_dtype": None if args.kv_dtype == "auto" else args.kv_dtype,
        "embeddings_on_host": args.embeddings_on_host,
        "fused_kernels": fused_by_default(args.fused_kernels, "cuda"),
        "resident_dtype": args.resident_dtype,
        "lend_arena": args.lend_arena,
    }
    if args.model is not None:
        if args.arch is not None or args.set:
            raise ValueError("--arch and --set go with --preset; a model directory has its own config")
        plan_of = functools.partial(plan_for_dir, args.model, **settings)
    else:
        from common.model.hf_config import parse_architecture
        from common.model.synthetic.config import model_config, parse_overrides

        hf = model_config(args.preset, args.arch, parse_overrides(args.set))
        arch, cfg = parse_architecture(hf, Path(f"<preset {args.preset}>/config.json"))
        plan_of = functools.partial(plan_memory, cfg, arch, **settings)
    if args.expert_format == "auto":
        plan = auto_plan(lambda fmt: plan_of(expert_format=fmt))
    else:
        plan = plan_of(expert_format=args.expert_format)
    print(json.dumps(plan_dict(plan)) if args.json else format_plan(plan))
    plan.check()  # a refused plan is printed, then named as the error
    return 0


def _serve(args: argparse.Namespace) -> int:
    import os

    from common.api_key import resolve_api_key
    from common.config import resolve_dtype
    from common.model.defaults import default_model_dir
    from common.model.hf_config import load_architecture
    from services.exit_now import exit_now
    from services.launch import Launcher, ServeOptions, pair_gpus
    from services.logs import log_choice_env, setup_logging
    from services.worker_args import config_argv, device_arg, worker_config

    setup_logging("launch", args.log_level, args.log_format)
    os.environ.update(log_choice_env(args.log_level, args.log_format))  # the services inherit the choice
    if args.ray is None:  # the workers run here: a device this machine has
        try:
            args.device = device_arg(args.device)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"--device: {exc}") from None
    if args.model is None and args.expert_cache is None and args.vram_budget is None:
        args.expert_cache = DEFAULT_SERVE_CACHE  # the embedded default shows what Spillway is for
        logging.getLogger("launch").info("the embedded model's experts: through a cache of half of them")
    model_dir = str(Path(args.model or default_model_dir()).absolute())  # (the same path on every node)
    _, model = load_architecture(model_dir)  # a bad config fails here, with its file named, before any start
    cfg = worker_config(args, model_dir)
    _check_before_start(args, cfg, model)
    if cfg.vram_budget is not None:  # (a budget is for a GPU: `auto` under --ray is one of the nodes')
        _check_serve_plan(dataclasses.replace(cfg, device="cuda") if cfg.device == "auto" else cfg)
    gpus: list[str | None] = pair_gpus(args.pairs, cfg.device) if args.ray is None else [None] * args.pairs
    encoder = _encoder_device(args, model_dir)
    opts = ServeOptions(
        model_dir=model_dir,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        served_name=args.served_model_name,
        api_key=resolve_api_key(args.api_key, args.api_key_file),
        max_image_pixels=args.max_image_pixels,
        max_request_pixels=args.max_request_pixels,
        max_queue=args.max_queue,
        worker_args=config_argv(cfg),
        max_context=cfg.max_context,
        threads=args.threads,
        stall_timeout_s=args.stall_timeout,
        heartbeat_timeout_s=args.heartbeat_timeout,
        pair_gpus=gpus,
        encoder_device=encoder,
        encoder_dtype=resolve_dtype(cfg.dtype, encoder or "cpu"),
        grammar_max_bytes=cfg.grammar_max_bytes,
        port_range=args.port_range,
    )
    if args.ray is None and args.port_range is not None:
        raise ValueError("--port-range: the ports --ray picks on its nodes (without it, give --metrics-port)")
    if args.ray is None:  # (under Ray, the router's node binds them)
        _check_ports(opts)
    if args.ray is not None:
        from services.ray_launch import RayLauncher

        return RayLauncher(opts, args.ray, args.pairs, cfg.device).run()
    exit_now(Launcher(opts).run())  # (the interpreter's teardown of what the checks loaded takes seconds)


def _encoder_device(args: argparse.Namespace, model_dir: str) -> str | None:
    """Where `serve` runs the vision encoder (on this machine, with --ray too): --encoder-device for a model
    with a vision tower, else (a text-only model, --no-encoder) None; ValueError for a device this machine
    lacks (its rows are in host shared memory: any GPU of this machine serves every pair)."""
    from services.launch import has_vision

    if args.no_encoder or not has_vision(model_dir):
        return None
    try:
        device = device_arg(args.encoder_device)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"--encoder-device: {exc}") from None
    return device


def _check_before_start(args: argparse.Namespace, cfg, model) -> None:
    """ValueError for what the workers would refuse only once started (each of their restarts failing
    alike): the model's files (every safetensors header, every tensor the config asks for), the expert
    cache's size, the tokenizer."""
    from common.experts.offload import parse_capacity
    from common.model.loader import check_checkpoint
    from common.text.tokenizer import Tokenizer

    check_checkpoint(cfg.model_dir)
    if cfg.expert_cache is not None:
        parse_capacity(cfg.expert_cache, len(model.moe_layers), model.num_experts)
    Tokenizer.from_dir(cfg.model_dir)


def _check_ports(opts) -> None:
    """OSError for a port the services would bind that is taken (another server on it): the API's and
    every metrics port (ServeOptions.ports)."""
    from common.ipc.ports import check_free

    for what, port in opts.ports().items():
        check_free(opts.host, port, what)


def _check_serve_plan(cfg) -> None:
    """Refuse a --vram-budget before any process starts, with the plan decode would compute (and log it)."""
    from common.engine.memory_plan import format_plan
    from common.workers.decode import apply_memory_plan

    _, plan = apply_memory_plan(cfg)
    assert plan is not None  # cfg has a vram_budget
    logging.getLogger("launch").info("memory plan:\n%s", format_plan(plan))


BENCHMARKS = {
    "decode-1": ("bench.decode_offload", []),
    "decode-8": ("bench.decode_offload", ["--lanes", "8"]),
    "decode-allfit": ("bench.decode_offload", ["--all-fit"]),
    "peer-hf": ("bench.peer_hf", []),
    "prefill-25k": ("bench.prefill", ["--prompt", "25600"]),
    "prefill-128k": ("bench.prefill", ["--prompt", "131072"]),
    "policy": ("bench.policy", []),
    "prompt-seeding": ("bench.prompt_seeding", []),
    "serve-ipc": ("bench.serve_ipc", []),
    "qwen4-smoke": ("bench.qwen4_smoke", []),
    "expert-formats": ("bench.expert_formats", []),
}
"""`spillway bench NAME` → the module that runs it and the flags that make it NAME (bench/README.md says
what each measures)."""


def _bench(args: argparse.Namespace) -> int:
    import runpy

    if not (Path.cwd() / "bench" / "common.py").is_file():
        raise ValueError("run `spillway bench` from the repository root (bench/ is not installed)")
    sys.path.insert(0, str(Path.cwd()))
    module, flags = BENCHMARKS[args.name]
    sys.argv = [f"spillway bench {args.name}", *flags, *args.args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


def _add_bench(sub) -> None:
    b = sub.add_parser("bench", help="run a benchmark from bench/ (results in bench/results/NAME.json)")
    b.add_argument("name", choices=sorted(BENCHMARKS))
    b.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own flags")
    b.set_defaults(func=_bench)


def _port_range(text: str) -> tuple[int, int]:
    from common.ipc.ports import parse_port_range

    try:
        return parse_port_range(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_serve(sub) -> None:
    srv = sub.add_parser("serve", help="serve the OpenAI-compatible API (router, prefill, decode processes)")
    add_config_args(srv, model_required=False, device_here=False)  # checked in _serve, unless --ray
    srv.add_argument("--host", default="127.0.0.1")
    add_log_args(srv)
    srv.add_argument("--port", type=int_at_least(1), default=8000)
    srv.add_argument(
        "--metrics-port",
        type=int_at_least(0),
        default=0,
        help="metrics ports: the router's M, then each pair's prefill and decode on the next two, then the "
        "vision encoder's",
    )
    srv.add_argument(
        "--pairs",
        type=int_at_least(1),
        default=1,
        help="prefill/decode worker pairs the router spreads requests over (on CUDA: a GPU each; "
        "default %(default)s)",
    )
    srv.add_argument(
        "--ray",
        metavar="ADDRESS",
        default=None,
        help="place the pairs on the nodes of this Ray cluster (`auto`: the one `ray start` joined this "
        "machine to; `local`: one of this machine alone), the router here (needs the `ray` extra)",
    )
    srv.add_argument(
        "--port-range",
        metavar="FIRST-LAST",
        type=_port_range,
        default=None,
        help="with --ray: the TCP ports picked on every node (the services' inboxes and metrics ports), "
        "for a firewall that opens only these (default: any free one)",
    )
    srv.add_argument(
        "--encoder-device",
        type=device_name,
        default="cpu",
        help="where the vision encoder runs (a model with a vision tower; default %(default)s; cuda:N: a GPU "
        "of its own)",
    )
    srv.add_argument(
        "--no-encoder",
        action="store_true",
        help="start no vision encoder, even for a model that reads images",
    )
    srv.add_argument("--served-model-name", default="", help="the model's name in the API")
    srv.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1, /metrics and the metrics ports (ps shows this "
        "command line: prefer --api-key-file or $SPILLWAY_API_KEY)",
    )
    srv.add_argument(
        "--api-key-file", metavar="PATH", default=None, help="read the key from this file's first line"
    )
    srv.add_argument(
        "--max-image-pixels",
        type=int_at_least(1),
        default=None,
        help="most pixels of one image a request carries (a 400 beyond; default: the router's)",
    )
    srv.add_argument(
        "--max-request-pixels",
        type=int_at_least(1),
        default=None,
        help="most pixels of all of a request's images (a 400 beyond; default: the router's)",
    )
    srv.add_argument(
        "--max-queue", type=int_at_least(0), default=64, help="requests waiting beyond those (then 429)"
    )
    srv.add_argument(
        "--stall-timeout",
        type=float_at_least(0.0),
        default=120.0,
        help="seconds a worker's loop may go without coming round before it is taken as hung: its requests "
        "fail and it is restarted (0: never; default %(default)s)",
    )
    srv.add_argument(
        "--heartbeat-timeout",
        type=float_at_least(0.1),
        default=5.0,
        help="seconds without a worker's heartbeat (sent every second from a thread of its own) before it "
        "counts as down: 503 while no pair is up (default %(default)s)",
    )
    srv.set_defaults(func=_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spillway", description="Serve MoE models bigger than the GPU.")
    sub = parser.add_subparsers(dest="command", required=True)

    mk = sub.add_parser("make-model", help="write a synthetic checkpoint in the HF on-disk format")
    mk.add_argument("--preset", default="tiny", help="tiny | qwen3-30b | flashnext | glm-4.5-air")
    mk.add_argument(
        "--arch",
        default=None,
        help="qwen3_moe | qwen2_moe | mixtral | glm4_moe | qwen4_exp | qwen3_next (default: the preset's)",
    )
    mk.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field; VALUE is parsed as JSON where it can be",
    )
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument(
        "--quantize",
        default=None,
        choices=["fp8", "nvfp4", "mxfp4", "gptq", "gptq-desc-act", "awq", "w4a16", "w4a16-asym", "nvfp4a16"],
        help="write a quantized variant (flat archs): HF block FP8, ModelOpt NVFP4 or gpt-oss MXFP4 experts, "
        "GPTQModel int4 (gptq: desc_act false; gptq-desc-act: true), AutoAWQ int4 (GEMM), or "
        "llm-compressor's compressed-tensors W4A16 (symmetric or not) or NVFP4A16; int4 groups of 128 where "
        "the dims allow, else smaller",
    )
    mk.add_argument("--out", required=True)
    mk.add_argument("--force", action="store_true", help="replace --out if it exists and is not empty")
    mk.set_defaults(func=_make_model)

    keys = sub.add_parser(
        "keys",
        help="write CurveZMQ keys for services no launcher starts (containers: SPILLWAY_CONTROL_KEYS_FILE)",
    )
    keys.add_argument("--out", required=True, help="directory of the key files (NAME.json, mode 0600)")
    keys.add_argument("names", nargs="+", help="the services' names (router, prefill, decode, encoder, ...)")
    keys.set_defaults(func=_keys)

    gen = sub.add_parser("generate", help="generate text offline, in this process")
    gen.add_argument(
        "--model", default=None, help="model directory (default: the tiny model, created on first use)"
    )
    what = gen.add_mutually_exclusive_group()
    what.add_argument("--prompt", default=None, help="raw prompt text")
    what.add_argument("--chat", default=None, help="a user message, wrapped in the chat template")
    gen.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="FILE",
        help="an image (PNG, JPEG, WebP, GIF) before --chat's text (repeat for several; a model with a "
        "vision tower)",
    )
    gen.add_argument("--max-tokens", type=int_at_least(1), default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int_at_least(0), default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", choices=DTYPES, default="float32")
    gen.add_argument("--device", type=device_arg, default="cpu", help="cpu | cuda | cuda:N | auto")
    gen.add_argument(
        "--speculative",
        choices=["mtp"],
        default=None,
        help="draft with the model's MTP head, verify with the trunk (greedy requests)",
    )
    gen.add_argument(
        "--num-draft", type=int_at_least(1), default=2, help="tokens drafted per step with --speculative"
    )
    gen.add_argument(
        "--expert-cache",
        default=None,
        metavar="SLOTS|FRACTION|all",
        help="serve routed experts from host memory through a VRAM cache of this size",
    )
    gen.add_argument("--cache-policy", default=DEFAULT_POLICY, choices=POLICIES)
    gen.add_argument(
        "--expert-format",
        default="bf16",
        choices=PACKED_FORMATS,
        help="runtime format of the offloaded experts (an artifact has its own)",
    )
    gen.add_argument(
        "--pin-experts",
        default=None,
        metavar="FILE",
        help="JSON {MoE layer index: [experts]} kept cached for good (a calibration hot set)",
    )
    add_prefill_args(gen)
    add_placement_args(gen)
    gen.add_argument(
        "--lend-arena",
        action="store_true",
        help="lend the prefill arena's second buffer to the expert cache between prefills (E more slots)",
    )
    add_lookahead_arg(gen)
    gen.add_argument(
        "--vram-budget",
        type=size_arg,
        default=None,
        metavar="SIZE",
        help="device memory cap (32GiB, 500MiB, bytes): the expert cache gets what the memory plan leaves",
    )
    gen.add_argument("--record-routing", default=None, metavar="FILE", help="save the router's choices")
    gen.add_argument(
        "--replay-routing",
        default=None,
        metavar="FILE|synthetic-zipf:KEY=VAL,...",
        help="force the router's choices from a trace",
    )
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.set_defaults(func=_generate)

    conv = sub.add_parser("convert", help="convert a checkpoint into a runtime artifact (packed experts)")
    conv.add_argument("src")
    conv.add_argument("dst")
    conv.add_argument(
        "--experts",
        default="int4",
        help="the experts' format: bf16, fp8, int4 (dims multiples of 128), or a published one (nvfp4, "
        "mxfp4, gptq[-gN], awq[-gN], ct-...); the error it adds is printed",
    )
    conv.add_argument("--force", action="store_true", help="replace dst if it exists and is not empty")
    conv.set_defaults(func=_convert)

    sim = sub.add_parser("simulate", help="replay a routing trace against every cache policy and Belady's")
    sim.add_argument(
        "--trace", required=True, help="a trace file, or synthetic-zipf[:KEY=VAL,...] (see BENCHMARKS.md)"
    )
    sim.add_argument(
        "--capacity", type=_fraction, required=True, help="cached fraction of each layer's experts (0, 1]"
    )
    sim.add_argument("--json", action="store_true", help="print one JSON object")
    sim.set_defaults(func=_simulate)
    _add_serve(sub)
    _add_bench(sub)
    _add_plan(sub)
    return parser


def _add_plan(sub) -> None:
    plan = sub.add_parser(
        "plan", help="print how a --vram-budget is spent (from the config alone: nothing is loaded)"
    )
    what = plan.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", default=None, help="model directory or converted artifact")
    what.add_argument(
        "--preset",
        default=None,
        help="a synthetic preset's config: tiny | qwen3-30b | flashnext | glm-4.5-air | qwen3-next-80b",
    )
    plan.add_argument("--arch", default=None, help="the preset's arch (default: its first)")
    plan.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a preset's config field"
    )
    plan.add_argument(
        "--vram-budget", type=size_arg, required=True, metavar="SIZE", help="32GiB, 500MiB, bytes"
    )
    plan.add_argument("--max-context", type=int_at_least(2), default=4096)
    plan.add_argument("--max-running", type=int_at_least(1), default=8)
    plan.add_argument(
        "--expert-format",
        default="auto",
        type=_plan_format,
        metavar="FORMAT",
        help=f"{', '.join(PACKED_FORMATS)}, or (a preset) a published format's bytes: nvfp4, mxfp4, "
        "gptq, awq, ct-w4a16, ...; a published checkpoint's own (default auto: as serve chooses, the first "
        "of bf16, fp8, int4 that fits)",
    )
    plan.add_argument(
        "--dtype", choices=["auto", *DTYPES], default="auto", help="default auto: as serve on CUDA, bfloat16"
    )
    add_prefill_args(plan)
    add_placement_args(plan)
    add_fused_kernels_arg(plan)  # a plan is for a GPU: None plans the fused kernels' workspace
    plan.add_argument(
        "--single-process",
        action="store_true",
        help="plan `spillway generate` (prefill and decode in one process) rather than `spillway serve`",
    )
    plan.add_argument(
        "--lend-arena", action="store_true", help="serve's --lend-arena: decode holds prefill's arena rows"
    )
    plan.add_argument("--json", action="store_true", help="print one JSON object (bytes)")
    plan.set_defaults(func=_plan)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate" and args.prompt is None and args.chat is None:
        args.chat = "Tell me about experts."
    try:
        return args.func(args)
    except (ValueError, OSError) as exc:  # CheckpointError is a ValueError; a path that cannot be written
        print(f"spillway: error: {exc}", file=sys.stderr)
        return 2
    except jinja2.TemplateError as exc:  # the chat template failed on this conversation (raise_exception)
        print(f"spillway: error: the chat template: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
