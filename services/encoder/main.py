"""Vision encoder worker: a thin loop around EncoderCore — receive `Encode`, encode the head of the queue,
lend its rows to the request's prefill worker, heartbeat."""

from __future__ import annotations

import argparse
import logging

import torch

from common.ipc import tensors as ipc
from common.ipc.transport import pair_names
from common.metrics import EncoderMetrics
from common.protocol import Abort, Encode, ImagesTaken, Message, PairMoved, Tokens
from common.vision.images import vision_config
from common.workers.encoder import EncoderCore
from common.workers.encoder_metrics import EncoderMetricsExporter
from services.worker_args import device_arg, float_at_least, int_at_least
from services.worker_loop import WorkerShell

log = logging.getLogger("encoder")
CAPACITY = 64
"""The requests the encoder announces it takes at once (`Ready.capacity`): the router's bound on those it
sends; the core's own queue has none (a request waits there for rows, not for a lane)."""
DEFAULT_ROWS = 16384
"""Rows of the output buffer (image tokens of the requests lent at once): 16384 × 4096 bf16 is 128 MiB."""


def named_address(text: str) -> tuple[str, str]:
    """argparse type of `NAME=ADDRESS`: a prefill worker's service name and its inbox."""
    name, sep, address = text.partition("=")
    if not sep or not name or not address:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=ADDRESS (prefill=ipc:///run/prefill.sock)")
    return name, address


def encoder_parser() -> argparse.ArgumentParser:
    """The encoder's command line (`python -m services.encoder`; the launcher builds it in `encoder_argv`)."""
    p = argparse.ArgumentParser(prog="spillway-encoder", description=__doc__)
    p.add_argument("--model", required=True, help="model directory (its config.json has a vision_config)")
    p.add_argument("--inbox", required=True, help="this worker's PULL address")
    p.add_argument("--router", required=True, help="the router's inbox address")
    p.add_argument(
        "--prefill",
        type=named_address,
        action="append",
        default=[],
        metavar="NAME=ADDRESS",
        help="a prefill worker's service name and inbox (repeatable: one a pair); `Encode` names the one",
    )
    p.add_argument("--device", type=device_arg, default="cpu", help="cpu | cuda | cuda:N | auto")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--rows",
        type=int_at_least(1),
        default=DEFAULT_ROWS,
        help="rows of the output buffer: image tokens lent to prefill at once (default %(default)s)",
    )
    p.add_argument("--threads", type=int_at_least(0), default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--name", default="encoder", help="the service name it announces (default %(default)s)")
    p.add_argument("--metrics-port", type=int_at_least(0), default=0, help="Prometheus port (0: none)")
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="interface the metrics port binds (0.0.0.0 in a container; default %(default)s)",
    )
    p.add_argument(
        "--stall-timeout",
        type=float_at_least(0.0),
        default=120.0,
        help="seconds the loop may stall once ready before the process takes itself as hung and exits "
        "(0: never; default %(default)s)",
    )
    p.add_argument(
        "--exit-with-parent", action="store_true", help="stop once the process that started this one is gone"
    )
    p.add_argument(
        "--if-vision",
        action="store_true",
        help="exit 0 (not 2) for a model without a vision tower: a deployment that starts the encoder "
        "whatever the model (docker-compose)",
    )
    p.add_argument(
        "--inline",
        action="store_true",
        help="send the embeddings in the messages, not in shared memory (prefill workers on other machines: "
        "serve --ray); --rows then only bounds a request",
    )
    return p


def prefill_outboxes(parser: argparse.ArgumentParser, pairs: list[tuple[str, str]]) -> dict[str, str]:
    """--prefill's name → address; a missing or repeated name ends the process as argparse does (exit 2)."""
    if not pairs:
        parser.error("at least one --prefill NAME=ADDRESS: the encoder's results go to a prefill worker")
    names = [name for name, _ in pairs]
    if len(set(names)) < len(names) or "router" in names:
        parser.error(f"--prefill names must differ, and none be `router`: {names}")
    return dict(pairs)


def handle(core: EncoderCore, shell: WorkerShell, msg: Message) -> None:
    if isinstance(msg, Encode):
        if msg.prefill not in shell.out or msg.prefill == "router":
            error = f"the encoder knows no prefill worker {msg.prefill!r} (its --prefill)"
            log.error("Encode for %s: %s", msg.rid, error)
            shell.send("router", Tokens(msg.rid, [], "error", error=error))  # else prefill waits for good
            return
        core.submit(msg)
    elif isinstance(msg, ImagesTaken):
        core.taken(msg.rid)
    elif isinstance(msg, Abort):
        core.abort(msg.rid)
    elif isinstance(msg, PairMoved):
        name = pair_names(msg.index)[0]
        if name in shell.out:
            log.info("%s moved to %s", name, msg.prefill)
            shell.reconnect(name, msg.prefill)
    else:
        log.warning("unexpected %s", type(msg).__name__)


def start_core(args: argparse.Namespace) -> EncoderCore | int:
    """The core, or the exit code that says why there is none (logged): 2 for a model without a vision tower
    (0 with --if-vision) or one that does not load."""
    try:
        if vision_config(args.model) is None:
            if args.if_vision:
                log.info("%s has no vision_config: a text-only model has nothing to encode", args.model)
                return 0
            log.error("cannot start: %s/config.json has no vision_config (a text-only model)", args.model)
            return 2
        dtype = getattr(torch, args.dtype)
        return EncoderCore.from_model_dir(args.model, args.rows, dtype, args.device, inline=args.inline)
    except (ValueError, OSError) as exc:  # a bad checkpoint, /dev/shm too small: say why (no restart helps)
        log.error("cannot start: %s", exc)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = encoder_parser()
    args = parser.parse_args(argv)
    outboxes = prefill_outboxes(parser, args.prefill)
    shell = WorkerShell.from_args(args, "encoder", outboxes=outboxes)
    ipc.unlink_stale()  # the buffer of a crashed predecessor where no launcher swept after it (a container)
    core = start_core(args)
    if isinstance(core, int):
        shell.close()
        return core
    exporter = EncoderMetricsExporter(core, EncoderMetrics.create(shell.registry))  # on the shell's port
    shell.ready(CAPACITY, 0, core.capacity)
    buffer = core.buffer  # (None: `inline`)
    where = "in the messages" if buffer is None else f"rows of {buffer.shape[1]} on {buffer.device}"
    log.info("ready: %d rows a request at most, %s", core.capacity, where)
    while not shell.stopping:
        for msg in shell.receive(busy=core.busy):
            try:
                handle(core, shell, msg)
            except Exception:  # one bad message is logged, not the end of the worker
                log.exception("failed to handle %s", type(msg).__name__)
        sent = []
        if core.busy:  # a tower pass, which may outlast the router's heartbeat timeout
            with shell.working(core.running, core.waiting):
                sent = core.step()
        for dest, out in sent:
            shell.send(dest, out)
        if shell.heartbeat_due():
            exporter.update()
            shell.heartbeat(core.running, core.waiting)
    shell.close()
    return 0
