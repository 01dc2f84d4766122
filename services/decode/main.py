"""Decode worker: a thin loop around DecodeCore — receive, decode a step, send tokens, heartbeat."""

from __future__ import annotations

import argparse
import logging

from common.protocol import (
    Abort,
    AllocState,
    Message,
    PrefillDone,
    ReleaseState,
    Thaw,
    Tokens,
    WantExports,
)
from common.workers.decode import DecodeCore
from common.workers.sharing import decode_exports, host_allocator, shared_allocator
from services.worker_args import add_worker_args, worker_config
from services.worker_loop import WorkerShell

log = logging.getLogger("decode")


def handle(core: DecodeCore, shell: WorkerShell, msg: Message, exports) -> None:
    if isinstance(msg, AllocState):
        for grant in core.alloc_state(msg):
            shell.send("prefill", grant)
    elif isinstance(msg, PrefillDone):
        core.prefill_done(msg)
    elif isinstance(msg, Abort | ReleaseState):
        core.release(msg.rid)
        for grant in core.grant_pending():
            shell.send("prefill", grant)
    elif isinstance(msg, Thaw):
        core.set_freeze(msg.holder, False)
    elif isinstance(msg, WantExports):  # a (re)started prefill: what its predecessor held is lost
        for rid in [*core.granted, *(ask.rid for ask in core.pending)]:
            core.release(rid)
        shell.send("prefill", exports)
    else:
        log.warning("unexpected %s", type(msg).__name__)


def step(core: DecodeCore, shell: WorkerShell) -> None:
    """One decode step; a failure ends the running requests with an error event instead of the worker."""
    try:
        events = core.step()
    except Exception as exc:
        log.exception("decode step failed")
        events = [Tokens(rid, [], "error", error=f"decode failed: {exc}") for rid in list(core.running)]
        for event in events:
            core.release(event.rid)
    for event in events:
        shell.send("router", event)
    if any(e.finish_reason for e in events):
        for grant in core.grant_pending():
            shell.send("prefill", grant)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spillway-decode", description=__doc__)
    add_worker_args(parser)
    args = parser.parse_args(argv)
    outboxes = {"router": args.router, "prefill": args.peer}
    shell = WorkerShell("decode", args.inbox, outboxes, args.threads, args.metrics_port)
    core = DecodeCore(worker_config(args), shared_allocator, host_allocator)
    exports = decode_exports(core)
    shell.watch_experts(core.engine.model.experts)
    shell.send("prefill", exports)
    shell.ready(core.cfg.max_running)
    log.info("ready: %d lanes, %d pages", core.cfg.max_running, core.pool.num_pages)
    while not shell.stopping:
        for msg in shell.receive(busy=bool(core.running)):
            handle(core, shell, msg, exports)
        step(core, shell)
        stats = core.stats()  # host-side counts: cheap enough to publish every step
        shell.metrics.kv_pages_used.set(stats.pages_used)
        shell.metrics.kv_pages_free.set(stats.pages_free)
        shell.metrics.requests_running.set(stats.running)
        if shell.heartbeat_due():
            shell.heartbeat(stats.running, stats.waiting)
    shell.close()
    return 0
