"""`python -m services.router`: run the router (the launcher and docker-compose start it this way)."""

from __future__ import annotations

import argparse
import json
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.api_key import API_KEY_ENV, resolve_api_key
from common.config import GRAMMAR_MAX_BYTES
from common.ipc.keys import ControlKeys
from services.logs import add_log_args, setup_logging
from services.parent_watch import RESTARTS_ENV, stop_with_parent
from services.router.config import RouterConfig, WorkerPair

SHUTDOWN_GRACE_S = 1
"""Seconds the streams get to finish on SIGTERM (uvicorn takes whole seconds)."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m services.router", description="Spillway's OpenAI-compatible router."
    )
    p.add_argument("--model", help="HF model directory (default: the embedded tiny model)")
    p.add_argument("--served-model-name", help="model id clients use (default: the directory's name)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default: %(default)s)")
    p.add_argument("--inbox", required=True, help="ZeroMQ address the router binds (ipc://... or tcp://...)")
    p.add_argument(
        "--prefill",
        action="append",
        required=True,
        help="a prefill worker's inbox address (repeat for each pair of workers, in the order of --decode)",
    )
    p.add_argument(
        "--decode",
        action="append",
        required=True,
        help="the inbox of the decode worker of that pair (the nth --decode pairs with the nth --prefill)",
    )
    p.add_argument(
        "--encoder",
        default="",
        help="the vision encoder's inbox address (none: requests with images get a 400)",
    )
    p.add_argument("--max-running", type=int, default=0, help="requests in flight (0: the workers' capacity)")
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting beyond those (then 429)")
    p.add_argument("--max-context", type=int, help="prompt + completion tokens (default: the model's)")
    p.add_argument(
        "--grammar-max-bytes",
        type=int,
        default=GRAMMAR_MAX_BYTES,
        help="largest structured output's form, in bytes of JSON (then 400; default %(default)s)",
    )
    p.add_argument(
        "--api-key",
        help=f"require this Bearer key on /v1, /metrics (ps shows it: use --api-key-file, ${API_KEY_ENV})",
    )
    p.add_argument(
        "--api-key-file",
        metavar="PATH",
        help=f"read the key from this file (default: ${API_KEY_ENV}, else none)",
    )
    p.add_argument(
        "--max-image-pixels", type=int, default=RouterConfig.max_image_pixels, help="most pixels of one image"
    )
    p.add_argument(
        "--max-request-pixels",
        type=int,
        default=RouterConfig.max_request_pixels,
        help="most pixels of a request's images together",
    )
    p.add_argument(
        "--prompt-bytes-per-token",
        type=int,
        default=RouterConfig.prompt_bytes_per_token,
        help="a prompt's text may hold the context times this many bytes (a 400 beyond, before tokenizing)",
    )
    p.add_argument("--metrics-port", type=int, help="also serve /metrics on this port")
    p.add_argument(
        "--metrics-url",
        "--worker-metrics",
        dest="metrics_url",
        action="append",
        default=[],
        metavar="SERVICE=URL",
        help="a worker's metrics URL, shown by /health (repeatable)",
    )
    p.add_argument(
        "--heartbeat-timeout", type=float, default=5.0, help="seconds before a silent worker is down"
    )
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=120.0,
        help="seconds of silence after which a worker's requests fail (0: never; default %(default)s)",
    )
    p.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="shut down once the process that started this one is gone (its launcher, SIGKILLed)",
    )
    add_log_args(p)
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The RouterConfig the command line describes."""
    urls = {}
    for item in args.metrics_url:
        service, sep, url = item.partition("=")
        if not sep or not service or not url:
            raise SystemExit(f"--metrics-url expects SERVICE=URL, got {item!r}")
        urls[service] = url
    if len(args.prefill) != len(args.decode):
        raise SystemExit(
            f"--prefill and --decode pair up: {len(args.prefill)} prefill and {len(args.decode)} decode "
            "addresses"
        )
    try:
        api_key = resolve_api_key(args.api_key, args.api_key_file)
    except ValueError as exc:
        raise SystemExit(f"--api-key-file: {exc}") from None
    if args.model:
        model_dir = Path(args.model)
    else:
        from common.model.defaults import default_model_dir

        model_dir = default_model_dir()
    return RouterConfig(
        model_dir=model_dir,
        served_model_name=args.served_model_name,
        encoder=args.encoder,
        inbox=args.inbox,
        pairs=tuple(WorkerPair(p, d) for p, d in zip(args.prefill, args.decode, strict=True)),
        host=args.host,
        port=args.port,
        max_running=args.max_running,
        max_queue=args.max_queue,
        max_context=args.max_context,
        api_key=api_key,
        max_image_pixels=args.max_image_pixels,
        max_request_pixels=args.max_request_pixels,
        prompt_bytes_per_token=args.prompt_bytes_per_token,
        grammar_max_bytes=args.grammar_max_bytes,
        metrics_port=args.metrics_port,
        metrics_urls=urls,
        heartbeat_timeout_s=args.heartbeat_timeout,
        stall_timeout_s=args.stall_timeout,
        control_keys=ControlKeys.from_env(),
        restarts=restarts_from_env(),
    )


def restarts_from_env() -> dict[str, int]:
    """Each service's restarts so far by name, as the launcher that started this router counted them
    (`RESTARTS_ENV`: a JSON object; none where it is unset)."""
    text = os.environ.get(RESTARTS_ENV, "")
    try:
        counts = json.loads(text) if text else {}
    except ValueError:
        raise SystemExit(f"${RESTARTS_ENV} is no JSON object: {text!r}") from None
    if not isinstance(counts, dict) or not all(isinstance(n, int) for n in counts.values()):
        raise SystemExit(f"${RESTARTS_ENV} must map service names to counts: {text!r}")
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv`, build the app and serve it until SIGINT/SIGTERM (which abort what is in flight)."""
    import uvicorn

    from services.router.app import create_app
    from services.router.http import ErrorAnsweringH11

    args = parse_args(argv)
    setup_logging("router", args.log_level, args.log_format)
    config = config_from_args(args)
    if args.exit_with_parent:  # SIGTERM: uvicorn's own graceful shutdown
        stop_with_parent(lambda: os.kill(os.getpid(), signal.SIGTERM))
    app = create_app(config)
    server_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_config=None,  # setup_logging's handler
        access_log=False,  # services/router/middleware.py's lines instead
        http=ErrorAnsweringH11,
        # On SIGTERM, streams get this long to finish; then they are cancelled (and aborted at the workers).
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    supervisor = app.state.router.core.supervisor

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            supervisor.stopping = True  # the workers stop beside the router: their exits are expected
            super().handle_exit(sig, frame)

    Server(server_config).run()
    return 0
