"""Prefill worker: a thin loop around PrefillCore — map decode's exports, prefill chunk by chunk."""

from __future__ import annotations

import dataclasses
import logging

from common.engine.memory_plan import cap_worker
from common.model.qwen4_exp.positions import ImageTokens
from common.protocol import (
    Abort,
    Exports,
    Generate,
    ImagesEncoded,
    Message,
    StateGranted,
    Tokens,
    WantExports,
)
from common.workers.prefill import Outgoing, PrefillCore
from common.workers.sharing import prefill_model
from services.worker_args import parsed_config, worker_parser
from services.worker_loop import GRAMMAR_POLL_MS, WorkerShell

log = logging.getLogger("prefill")


class PrefillWorker:
    """The core once decode's exports have arrived (it is rebuilt when decode restarts)."""

    def __init__(self, shell: WorkerShell, cfg) -> None:
        self.shell, self.cfg = shell, cfg
        self.core: PrefillCore | None = None
        self.epoch: int | None = None
        self.early: list[Generate | ImagesEncoded | Abort] = []  # what came before the exports

    def attach(self, exports: Exports) -> Outgoing:
        if exports.epoch == self.epoch:
            return []
        first = self.core is None
        out = [] if self.core is None else self.core.fail_all("decode worker restarted")
        # decode's pools decide the context and page size (it may cap --max-context at the model's)
        cfg = dataclasses.replace(self.cfg, max_context=exports.max_context, page_size=exports.page_size)
        with self.shell.untimed():  # mapping a restarted decode's memory is start-up work, however long
            model, pools, eos = prefill_model(cfg, exports)
        image_tokens = ImageTokens.from_model_dir(cfg.model_dir)
        self.core, self.epoch = PrefillCore(cfg, model, pools, eos, image_tokens), exports.epoch
        self.shell.watch_experts(model.experts)
        if first:
            self.shell.ready(self.cfg.max_running, exports.max_context)
            log.info("ready: mapped %d tensors from decode", len(exports.tensors))
        for msg in self.early:
            out += self.handle(msg)
        self.early.clear()
        return out

    def handle(self, msg: Message) -> Outgoing:
        if isinstance(msg, Exports):
            return self.attach(msg)
        if isinstance(msg, Generate | ImagesEncoded | Abort) and self.core is None:
            self.early.append(msg)  # (an abort too: the embeddings of its request may come after it)
            return []
        # (a Generate, ImagesEncoded or Abort finds the core: before it, they wait in `early`)
        if isinstance(msg, Generate) and self.core is not None:
            return self.core.submit(msg)
        if isinstance(msg, ImagesEncoded) and self.core is not None:
            return self.core.images_encoded(msg)
        if isinstance(msg, Abort) and self.core is not None:
            return self.core.abort(msg.rid)
        if isinstance(msg, StateGranted) and self.core is not None:
            return self.core.granted(msg)
        return []

    def step(self) -> Outgoing:
        if self.core is None or not (self.core.busy or self.core.compiling):
            return []
        try:
            return self.core.step()
        except Exception as exc:
            log.exception("prefill failed")
            rid = self.core.job.gen.rid if self.core.job else ""
            out = self.core.abort(rid)
            return [("router", Tokens(rid, [], "error", error=f"prefill failed: {exc}")), *out]


def main(argv: list[str] | None = None) -> int:
    parser = worker_parser("spillway-prefill", __doc__)
    args = parser.parse_args(argv)
    cfg = parsed_config(parser, args)
    encoder = {"encoder": args.encoder} if args.encoder else None
    shell = WorkerShell.from_args(args, "prefill", "decode", encoder)
    cap_worker(cfg, "prefill")  # before CUDA starts: expandable segments, then prefill's part of the budget
    worker = PrefillWorker(shell, cfg)
    shell.send("decode", WantExports(shell.pid))
    while not shell.stopping:
        busy = worker.core is not None and worker.core.busy
        compiling = worker.core is not None and worker.core.compiling
        for msg in shell.receive(busy, GRAMMAR_POLL_MS if compiling else 100):
            try:
                outgoing = worker.handle(msg)
            except Exception:  # one bad message is logged, not the end of the worker
                log.exception("failed to handle %s", type(msg).__name__)
                continue
            for dest, out in outgoing:
                shell.send(dest, out)
        for dest, out in worker.step():
            shell.send(dest, out)
        if worker.core is not None and shell.heartbeat_due():
            shell.heartbeat(int(worker.core.busy), len(worker.core.queue))
    shell.close()
    return 0
