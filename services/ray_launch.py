"""`spillway serve --ray ADDRESS`: the router on this machine, each prefill/decode pair on a node of a Ray
cluster (a GPU each on CUDA), over tcp:// on the nodes' addresses.

Each pair runs under a `PairHost` (a Ray actor on its node). This process starts the actors, then the router
(and, for a model with a vision tower, the encoder, which sends the embeddings in its messages: the prefill
workers cannot map this machine's memory) over every pair's addresses, and supervises them, every host's check
under way at once. A pair host whose process dies is started again by Ray (`max_restarts`; on GPUs in its
bundle of the pairs' placement group); one that stops answering, or whose restarts are spent, is killed and a
new one started. Either way its workers take new ports, and the router and encoder are told the new
addresses (`PairMoved`): they stay up, and only that pair's requests fail.

Only strings and integers cross Ray's calls. Every node needs Spillway and the model at the same path.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from common.ipc.keys import KEYS_ENV, LAUNCHER, ControlKeys, keys_env, make_keys
from common.ipc.ports import free_ports
from common.ipc.transport import Outbox, pair_names
from common.protocol import PairMoved
from services.children import Child, restart_exited, stop_children, worker_argv
from services.launch import ServeOptions, child_env, encoder_argv, router_argv, worker_flags
from services.logs import setup_logging

log = logging.getLogger("launch")
SUPERVISE_S = 1.0
"""How often the pair hosts and the router are checked."""
CALL_TIMEOUT_S = 30.0
"""A pair host that does not answer a check this long is taken as lost (killed and started again)."""
HOST_RESTARTS = 3
"""Times Ray itself starts a pair host again after its process died (its workers start with it, at new
ports: the launcher asks for the addresses again); past that, the launcher starts a new host."""


class PairHost:
    """One prefill/decode pair's two workers on this node (a Ray actor: `ray.remote(PairHost)`): starts them
    as processes (ports chosen here), restarts one that exits (telling the router, whose requests on that
    pair then fail) and stops both with itself; the workers also stop once the actor's process is gone
    (`--exit-with-parent`)."""

    def __init__(
        self,
        index: int,
        flags: list[str],
        router_inbox: str,
        metrics: bool,
        keys: dict[str, str],
        span: tuple[int, int] | None = None,
    ) -> None:
        """`keys`: the control-plane keys (`ControlKeys.to_json`) of the pair's two workers and of the
        launcher (this host sends `ServiceDown` as it), by name; `span`: the ports to pick from (None: any
        free one)."""
        import ray

        setup_logging("pair")
        self.host = ray.util.get_node_ip_address()
        names = dict(zip(("prefill", "decode"), pair_names(index), strict=True))
        self.inboxes = {role: f"tcp://{self.host}:{free_ports(1, self.host, span)}" for role in names}
        self.metrics_urls: dict[str, str] = {}
        peer = {"prefill": "decode", "decode": "prefill"}
        self.children = []
        for role in ("decode", "prefill"):
            argv = worker_argv(
                role, names[role], self.inboxes[role], self.inboxes[peer[role]], router_inbox, flags
            )
            if metrics:
                port = free_ports(1, self.host, span)
                argv += ["--metrics-port", str(port), "--metrics-host", self.host]
                self.metrics_urls[names[role]] = f"http://{self.host}:{port}/metrics"
            self.children.append(Child(names[role], argv, env={KEYS_ENV: keys[names[role]]}))
        launcher = ControlKeys.from_json(keys[LAUNCHER])
        self.router = Outbox(router_inbox, keys=launcher, peer="router")
        for child in self.children:
            child.start()

    def addresses(self) -> tuple[str, str, dict[str, str]]:
        """The prefill and decode inboxes, and the workers' metrics URLs by name."""
        return self.inboxes["prefill"], self.inboxes["decode"], self.metrics_urls

    def supervise(self) -> str:
        """Restart the workers that exited; the name of one that keeps failing at start-up, else ""."""
        failed = restart_exited(self.children, self.router)
        return failed.name if failed is not None else ""

    def stop(self) -> None:
        stop_children(self.children)
        self.router.close()


@dataclass
class RayLauncher:
    """Starts the pair hosts on the cluster at `address` ("local": a cluster of this machine alone), then
    the router here; supervises both until SIGINT/SIGTERM."""

    opts: ServeOptions
    address: str
    pairs: int
    device: str
    stopping: bool = False
    failed: bool = False
    gpu: bool = False
    """Whether each pair takes a GPU (`device` cuda, or auto on a cluster that has GPUs)."""
    addresses: dict = field(default_factory=dict)
    """Each pair's (prefill inbox, decode inbox, metrics URLs by worker name), as its host answered."""
    placing: dict = field(default_factory=dict)
    """The pairs whose (new) host has not answered with its addresses yet: index → the pending answer."""
    checks: dict = field(default_factory=dict)
    """The pairs whose host has a check under way: index → (its pending answer, time.monotonic() sent)."""
    to_services: list = field(default_factory=list)
    """The launcher's connections to the router and the encoder (`PairMoved`)."""
    encoder_metrics: int = 0
    """The encoder's metrics port (0: none)."""
    placement: Any = None
    """On GPUs: the pairs' placement group (a bundle of one GPU a pair); None on the CPU."""

    def run(self) -> int:
        import signal

        import ray

        if self.device.startswith("cuda:"):
            raise ValueError(
                f"with --ray each pair takes one GPU of its node: --device cuda or auto, not {self.device}"
            )
        ray.init(address=self.address, include_dashboard=False)  # "local": always a new cluster
        for sig in (signal.SIGTERM, signal.SIGINT):  # (after ray.init, which installs its own)
            signal.signal(sig, lambda *_: setattr(self, "stopping", True))
        self.router: Child | None = None
        self.encoder: Child | None = None
        self.actors: list = []
        try:
            self._start()
            while not self.stopping:
                time.sleep(SUPERVISE_S)
                self._supervise()
        finally:
            self._stop()
            ray.shutdown()
        return 1 if self.failed else 0

    def _start(self) -> None:
        """The pair hosts, then (once every one is placed and has its addresses) the router over them."""
        import ray

        gpus = ray.cluster_resources().get("GPU", 0)
        self.gpu = self.device == "cuda" or (self.device == "auto" and gpus >= 1)
        if self.gpu and gpus < self.pairs:
            raise ValueError(f"--pairs {self.pairs} needs a GPU a pair; the Ray cluster has {gpus:g}")
        self.host = ray.util.get_node_ip_address()
        self.router_inbox = f"tcp://{self.host}:{self._port()}"
        has_encoder = self.opts.encoder_device is not None
        self.encoder_inbox = f"tcp://{self.host}:{self._port()}" if has_encoder else None
        names = [n for i in range(self.pairs) for n in pair_names(i)]
        self.keys = make_keys([*names, "router", "encoder", LAUNCHER])
        if self.gpu:  # a GPU a pair, spread over the nodes; Ray places a lost node's bundle again
            bundles = [{"GPU": 1} for _ in range(self.pairs)]
            self.placement = ray.util.placement_group(bundles, strategy="SPREAD", name="spillway-pairs")
        self.actors = [self._start_pair(i) for i in range(self.pairs)]
        self.placing = {i: self.actors[i].addresses.remote() for i in range(self.pairs)}
        while not self.stopping and self.placing:
            self._place(timeout_s=SUPERVISE_S)

    def _port(self) -> int:
        """A free port on this node (in `--port-range`, where given)."""
        return free_ports(1, self.host, self.opts.port_range)

    def _start_pair(self, index: int):
        import ray

        remote = ray.remote(num_gpus=1) if self.gpu else ray.remote(num_cpus=0)
        # the key (if any) and the log choice in the actor's environment, which its workers inherit: never on
        # their argv
        inherited = child_env(self.opts)
        env = {"env_vars": inherited} if inherited else None
        strategy: object = "SPREAD"
        if self.placement is not None:  # its GPU: bundle `index` of the pairs' placement group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            strategy = PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=index)
        actor = remote(PairHost).options(
            scheduling_strategy=strategy, runtime_env=env, max_restarts=HOST_RESTARTS, max_task_retries=0
        )
        flags = worker_flags(self.opts)
        # on a GPU: the actor's one (Ray sets its CUDA_VISIBLE_DEVICES, which the workers inherit)
        flags += ["--device", "cuda" if self.gpu else "cpu"]
        keys = {name: self.keys[name].to_json() for name in (*pair_names(index), LAUNCHER)}
        metrics = bool(self.opts.metrics_port)
        return actor.remote(index, flags, self.router_inbox, metrics, keys, self.opts.port_range)

    def _place(self, timeout_s: float) -> None:
        """Collect the addresses of the pair hosts being placed. The first time, once every one has answered,
        start the router (and encoder) over all of them; later, tell them of each pair placed again
        (`PairMoved`): they stay up, and only the moved pair's requests failed."""
        import ray

        ready, _ = ray.wait(list(self.placing.values()), num_returns=len(self.placing), timeout=timeout_s)
        if self.router is None and len(ready) < len(self.placing):
            return
        for i, ref in list(self.placing.items()):
            if ref in ready:
                del self.placing[i]
                try:
                    answer = ray.get(ref)
                except ray.exceptions.RayActorError:  # dead for good (its restarts spent): a new host
                    self._replace(i)
                    continue
                moved = i in self.addresses
                self.addresses[i] = answer
                if moved and self.router is not None:
                    self._tell_moved(i)
        if self.router is None and not self.placing:
            self._start_services()

    def _start_services(self) -> None:
        """The encoder (for a vision model) and the router, over every pair's addresses, and the launcher's
        connections to them (`PairMoved`)."""
        launcher = self.keys[LAUNCHER]
        self.to_services = [Outbox(self.router_inbox, keys=launcher, peer="router")]
        if self.encoder_inbox is not None:
            self.encoder_metrics = self._port() if self.opts.metrics_port else 0
            self.encoder = Child(
                "encoder",
                self._encoder_argv(),
                env={**child_env(self.opts), **keys_env(self.keys["encoder"])},
            )
            self.encoder.start()
            self.to_services.append(Outbox(self.encoder_inbox, keys=launcher, peer="encoder"))
        self.router = Child(
            "router", self._router_argv(), env={**child_env(self.opts), **keys_env(self.keys["router"])}
        )
        self.router.start()

    def _tell_moved(self, index: int) -> None:
        """Pair `index` answers at new addresses: tell the router and the encoder, and start them with those
        should they restart."""
        prefill, decode, _ = self.addresses[index]
        log.info("pair %d placed again: prefill at %s, decode at %s", index, prefill, decode)
        for box in self.to_services:
            if not box.try_send(PairMoved(index, prefill, decode)):
                log.error("%s does not read: pair %d's move not told", box.peer, index)
        assert self.router is not None
        self.router.argv = self._router_argv()
        if self.encoder is not None:
            self.encoder.argv = self._encoder_argv()

    def _metrics_urls(self) -> dict[str, str]:
        """Every worker's metrics URL by name (and the encoder's), as the pair hosts answered."""
        urls = {name: url for _, _, named in self.addresses.values() for name, url in named.items()}
        if self.encoder_inbox is not None and self.opts.metrics_port:
            urls["encoder"] = f"http://{self.host}:{self.encoder_metrics}/metrics"
        return urls

    def _router_argv(self) -> list[str]:
        pairs = [(self.addresses[i][0], self.addresses[i][1]) for i in range(self.pairs)]
        return router_argv(self.opts, self.router_inbox, pairs, self._metrics_urls(), self.encoder_inbox)

    def _encoder_argv(self) -> list[str]:
        """The encoder's command: on this machine, its embeddings in the messages (`--inline`)."""
        assert self.encoder_inbox is not None  # asked only where there is an encoder
        prefills = {pair_names(i)[0]: self.addresses[i][0] for i in range(self.pairs)}
        argv = [*encoder_argv(self.opts, self.encoder_inbox, self.router_inbox, prefills), "--inline"]
        if self.opts.metrics_port:
            argv += ["--metrics-port", str(self.encoder_metrics), "--metrics-host", self.host]
        return argv

    def _supervise(self) -> None:
        """Restart the local services that exited; collect the pair hosts' answers to their last checks,
        without waiting on any (one node that does not answer stalls none of the others), replacing a host
        that is lost or has not answered for CALL_TIMEOUT_S; then send the next checks."""
        import ray

        local = [c for c in (self.router, self.encoder) if c is not None]
        if restart_exited(local, None) is not None:
            self.failed = self.stopping = True
            return
        now = time.monotonic()
        refs = [ref for ref, _ in self.checks.values()]
        answered = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else set()
        for i, (ref, sent) in list(self.checks.items()):
            done = ref in answered
            if not done and now - sent < CALL_TIMEOUT_S:
                continue
            del self.checks[i]
            try:
                failed = ray.get(ref, timeout=0) if done else None
            except ray.exceptions.RayActorError as exc:  # its process died: Ray starts it again (new ports)
                log.error(
                    "the host of pair %d died (%s): asking its successor's addresses", i, type(exc).__name__
                )
                self.placing[i] = self.actors[i].addresses.remote()
                continue
            except ray.exceptions.RayTaskError:  # its check failed (not the host): try again next time
                log.exception("checking the workers of pair %d failed", i)
                continue
            if failed is None:
                log.error("the host of pair %d has not answered for %.0f s", i, now - sent)
                self._replace(i)
            elif failed:
                log.error("%s keeps failing at start-up: giving up", failed)
                self.failed = self.stopping = True
        for i, actor in enumerate(self.actors):
            if i not in self.placing and i not in self.checks:
                self.checks[i] = (actor.supervise.remote(), now)
        if self.placing:
            self._place(timeout_s=0)

    def _replace(self, index: int) -> None:
        """A new host for pair `index` (the old one killed): its workers start at new addresses."""
        import ray

        log.error("starting pair %d's host again", index)
        ray.kill(self.actors[index])
        self.actors[index] = self._start_pair(index)
        self.placing[index] = self.actors[index].addresses.remote()

    def _stop(self) -> None:
        import ray

        stop_children([c for c in (self.router, self.encoder) if c is not None])
        for box in self.to_services:
            box.close()
        stops = [actor.stop.remote() for actor in self.actors]  # together: a hung node delays none of them
        done, _ = ray.wait(stops, num_returns=len(stops), timeout=CALL_TIMEOUT_S) if stops else ([], [])
        if len(done) < len(stops):
            log.warning(
                "%d pair hosts did not stop their workers (they stop with them)", len(stops) - len(done)
            )
