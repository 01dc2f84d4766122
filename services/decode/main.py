"""Decode worker: a thin loop around DecodeCore — receive, decode a step, send tokens, heartbeat."""

from __future__ import annotations

import logging

import torch

from common import metrics
from common.config import format_bytes
from common.engine.memory_plan import cap_allocator, cap_worker, format_plan
from common.ipc import tensors as ipc
from common.protocol import (
    Abort,
    AllocState,
    Message,
    PrefillDone,
    ReleaseState,
    Thaw,
    WantExports,
)
from common.workers.decode import DecodeCore
from common.workers.sharing import decode_exports, host_allocator, shared_allocator
from services.worker_args import parsed_config, worker_parser
from services.worker_loop import GRAMMAR_POLL_MS, WorkerShell

log = logging.getLogger("decode")


def handle(core: DecodeCore, shell: WorkerShell, msg: Message, exports) -> None:
    if isinstance(msg, AllocState):
        for grant in core.alloc_state(msg):
            shell.send("prefill", grant)
    elif isinstance(msg, PrefillDone):
        core.prefill_done(msg)
        send_grants(core, shell)
    elif isinstance(msg, Abort):
        for refusal in core.abort(msg.rid):
            shell.send("prefill", refusal)
        send_grants(core, shell)
    elif isinstance(msg, ReleaseState):
        core.release(msg.rid)
        send_grants(core, shell)
    elif isinstance(msg, Thaw):
        core.set_freeze(msg.holder, False)
        send_grants(core, shell)  # a thawed cache can give lent pages back
    elif isinstance(msg, WantExports):  # a (re)started prefill: what its predecessor held is lost
        core.prefill_restarted()
        shell.send("prefill", exports)
    else:
        log.warning("unexpected %s", type(msg).__name__)


def send_grants(core: DecodeCore, shell: WorkerShell) -> None:
    """Grant what waits, now that pages, lanes or a thaw may have come."""
    for grant in core.grant_pending():
        shell.send("prefill", grant)


def step(core: DecodeCore, shell: WorkerShell) -> None:
    """One decode step; a failure ends the running requests with an error event instead of the worker."""
    try:
        events = core.step()
    except Exception as exc:
        log.exception("decode step failed")
        events = core.fail(f"decode failed: {exc}")
    for event in events:
        shell.send("router", event)
    if any(e.finish_reason for e in events):
        send_grants(core, shell)


def report_plan(core: DecodeCore, shell: WorkerShell) -> None:
    """Set the `vram_bytes` gauges (once: the pools are fixed at start): from the memory plan where there is
    one (logged, and on CUDA what decode holds against it), else as measured (`Engine.pool_bytes`)."""
    plan = core.plan
    if plan is None:
        for pool, nbytes in core.engine.pool_bytes().items():
            shell.metrics.vram_bytes.labels(pool=pool).set(nbytes)
        return
    log.info("memory plan:\n%s", format_plan(plan))
    for pool, nbytes in plan.pools().items():
        shell.metrics.vram_bytes.labels(pool=pool).set(nbytes)
    device = torch.device(core.cfg.device)
    if device.type == "cuda":
        held = torch.cuda.memory_allocated(device)
        arena = plan.arena if core.cfg.lend_arena else plan.arena // plan.processes  # --lend-arena: all of it
        planned = plan.weights + plan.kv + plan.expert_cache + arena
        log.info("decode holds %s; the plan gives its pools %s", format_bytes(held), format_bytes(planned))


def main(argv: list[str] | None = None) -> int:
    parser = worker_parser("spillway-decode", __doc__)
    args = parser.parse_args(argv)
    cfg = parsed_config(parser, args)
    shell = WorkerShell.from_args(args, "decode", "prefill")
    # Shared memory a crashed predecessor left where no launcher swept after it (one container a service).
    ipc.unlink_stale()
    try:
        plan = cap_worker(cfg, "decode")  # the budget is a hard cap: decode's part of it
        core = DecodeCore(cfg, shared_allocator, host_allocator)
        lending = core.engine.kv_lending
        if plan is not None and lending is not None:  # its pools are memory the allocator does not count
            cap_allocator(plan.process_budget("decode") - lending.memory.total_bytes, cfg.device)
    except ValueError as exc:  # a refused memory plan, a bad checkpoint: say why (the launcher gives up)
        log.error("cannot start: %s", exc)
        shell.close()
        return 2
    exports = decode_exports(core)
    kv_metrics = metrics.KvPoolMetrics.create(shell.registry)
    report_plan(core, shell)
    shell.watch_experts(core.engine.model.experts)
    shell.send("prefill", exports)
    shell.ready(core.cfg.max_running, core.runner.max_context)
    log.info("ready: %d lanes, %d pages", core.cfg.max_running, core.pool.num_pages)
    while not shell.stopping:
        for msg in shell.receive(busy=core.busy, wait_ms=GRAMMAR_POLL_MS if core.compiling else 100):
            try:
                handle(core, shell, msg, exports)
            except Exception:  # one bad message is logged, not the end of every running request
                log.exception("failed to handle %s", type(msg).__name__)
        step(core, shell)
        stats = core.stats()  # host-side counts: cheap enough to publish every step
        kv_metrics.pages_used.set(stats.pages_used)
        kv_metrics.pages_free.set(stats.pages_free)
        shell.metrics.requests_running.set(stats.running)
        if shell.heartbeat_due():
            shell.heartbeat(stats.running, stats.waiting)
    shell.close()
    return 0
