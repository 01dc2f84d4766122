"""Prometheus metric definitions shared by every service: one place for names and buckets
(docs/ARCHITECTURE.md, API and metrics).

Every metric is named `spillway:...` and lives in a per-service `CollectorRegistry` (never the global
default), so several services, or several instances of one in a test process, can each build their metrics
without name collisions. A service builds the groups it exports (`RouterMetrics`, `WorkerMetrics`,
`ExpertCacheMetrics`, `EncoderMetrics`) on its registry and serves it with `render` (inside its own HTTP app)
or `serve` (a separate metrics port).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from common.api_key import authorized

PREFIX = "spillway:"

# Time to first token spans queueing and a long prefill (seconds to minutes for 100K-token prompts).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
# Inter-token latency: ~10 ms at the target decode speed, up to seconds when a step waits on PCIe.
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
# Whole requests: up to many minutes for long generations.
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0)
# One request's vision tower pass: ~1 ms for a small image on a GPU, seconds for many large ones on the CPU.
ENCODE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def new_registry() -> CollectorRegistry:
    """A fresh registry for one service (no process or platform collectors: names stay `spillway:`)."""
    return CollectorRegistry(auto_describe=True)


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The registry in the Prometheus text format, and the content type to serve it with."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


def serve(
    registry: CollectorRegistry, port: int, host: str = "127.0.0.1", api_key: str | None = None
) -> Callable[[], None]:
    """Serve `registry` on http://host:port/metrics from a daemon thread (for workers without an HTTP app);
    with `api_key`, only to a request that carries it as a Bearer token (401 otherwise).

    Always in the text format, as the router's `/metrics` is: prometheus_client's own server answers
    Prometheus's preferred OpenMetrics with the names' colons turned into underscores in the samples (not in
    HELP or TYPE), so Prometheus stored a worker's `spillway:kv_pages_free` as `spillway_kv_pages_free`.
    Returns the function that stops the server (tests start and stop several in one process).
    """

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            if not authorized(self.headers.get("Authorization"), api_key):
                self.send_response(401)
                self.send_header("WWW-Authenticate", "Bearer")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body, content_type = render(registry)
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:  # a scrape every few seconds is not news
            pass

    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        daemon_threads = True

    server = Server((host, port), Handler)
    thread = threading.Thread(target=server.serve_forever, name=f"metrics:{port}", daemon=True)
    thread.start()

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return stop


ERROR_REASONS = ("bad_request", "unauthorized", "not_found", "queue_full", "not_ready", "worker_error",
                 "client_disconnect", "internal")  # fmt: skip
"""The router's usual `request_errors_total` reasons (an ApiError's code may add others)."""


@dataclass(frozen=True)
class RouterMetrics:
    """What the router sees of each request: latencies as the client sees them, tokens, admission."""

    time_to_first_token: Histogram
    inter_token_latency: Histogram
    e2e_request_latency: Histogram
    queue_time: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter
    requests_finished: Counter
    """Labelled by finish_reason (stop | length)."""
    requests_running: Gauge
    requests_waiting: Gauge
    request_errors: Counter
    """Labelled by reason (bad_request, unauthorized, not_found, queue_full, not_ready, worker_error, ...)."""
    dropped_frames: Counter
    """Inbox frames that did not decode (dropped and counted)."""
    late_heartbeats: Counter
    """Labelled by service: heartbeats that came past the heartbeat timeout (the worker counted as down)."""
    control_refused: Counter
    """Labelled by reason (`RefusalCount`): what the control-plane inbox refused."""
    pair_state: Gauge
    """Labelled by pair and state (starting, up, down): 1 on each pair's present state, 0 on the others."""
    pair_changes: Counter
    """Labelled by pair and state: how often the pair entered each state."""

    @classmethod
    def create(cls, registry: CollectorRegistry) -> RouterMetrics:
        metrics = cls(
            time_to_first_token=Histogram(
                f"{PREFIX}time_to_first_token_seconds",
                "Time from request arrival at the router to its first token.",
                buckets=TTFT_BUCKETS,
                registry=registry,
            ),
            inter_token_latency=Histogram(
                f"{PREFIX}inter_token_latency_seconds",
                "Time between consecutive tokens of a request (a multi-token event counts per token).",
                buckets=ITL_BUCKETS,
                registry=registry,
            ),
            e2e_request_latency=Histogram(
                f"{PREFIX}e2e_request_latency_seconds",
                "Time from request arrival to its last token.",
                buckets=E2E_BUCKETS,
                registry=registry,
            ),
            queue_time=Histogram(
                f"{PREFIX}request_queue_time_seconds",
                "Time a request waited in the router's admission queue.",
                buckets=TTFT_BUCKETS,
                registry=registry,
            ),
            prompt_tokens=Counter(
                f"{PREFIX}prompt_tokens_total", "Prompt tokens of admitted requests.", registry=registry
            ),
            generation_tokens=Counter(
                f"{PREFIX}generation_tokens_total", "Tokens generated.", registry=registry
            ),
            requests_finished=Counter(
                f"{PREFIX}requests_finished_total",
                "Requests that completed, by finish reason.",
                ["finish_reason"],
                registry=registry,
            ),
            requests_running=Gauge(
                f"{PREFIX}requests_running", "Requests sent on to the workers.", registry=registry
            ),
            requests_waiting=Gauge(
                f"{PREFIX}requests_waiting", "Requests waiting in the router's queue.", registry=registry
            ),
            request_errors=Counter(
                f"{PREFIX}request_errors_total",
                "Requests that ended in an error, by reason.",
                ["reason"],
                registry=registry,
            ),
            dropped_frames=Counter(
                f"{PREFIX}dropped_frames_total", "Inbox frames that did not decode.", registry=registry
            ),
            late_heartbeats=Counter(
                f"{PREFIX}late_heartbeats_total",
                "Worker heartbeats that came past the heartbeat timeout, by service.",
                ["service"],
                registry=registry,
            ),
            control_refused=_control_refused(registry),
            pair_state=Gauge(
                f"{PREFIX}pair_state",
                "Each prefill/decode pair's state: 1 on the present one (starting, up, down).",
                ["pair", "state"],
                registry=registry,
            ),
            pair_changes=Counter(
                f"{PREFIX}pair_state_changes_total",
                "How often each pair entered each state (starting, up, down).",
                ["pair", "state"],
                registry=registry,
            ),
        )
        for reason in ERROR_REASONS:  # a series each from the start (0 until one happens)
            metrics.request_errors.labels(reason=reason)
        return metrics


@dataclass(frozen=True)
class WorkerMetrics:
    """Load and memory of a worker (prefill, decode, the encoder); the KV pool's are decode's alone
    (`KvPoolMetrics`)."""

    requests_running: Gauge
    requests_waiting: Gauge
    vram_bytes: Gauge
    """Labelled by pool (weights, kv, arena, scratch, graphs, expert_cache)."""
    dropped_frames: Counter
    control_refused: Counter
    """Labelled by reason (`RefusalCount`): what the control-plane inbox refused."""

    @classmethod
    def create(cls, registry: CollectorRegistry) -> WorkerMetrics:
        return cls(
            requests_running=Gauge(
                f"{PREFIX}requests_running", "Requests this worker is running.", registry=registry
            ),
            requests_waiting=Gauge(
                f"{PREFIX}requests_waiting", "Requests queued in this worker.", registry=registry
            ),
            vram_bytes=Gauge(
                f"{PREFIX}vram_bytes", "Device memory held, by pool.", ["pool"], registry=registry
            ),
            dropped_frames=Counter(
                f"{PREFIX}dropped_frames_total", "Inbox frames that did not decode.", registry=registry
            ),
            control_refused=_control_refused(registry),
        )


@dataclass(frozen=True)
class KvPoolMetrics:
    """The paged KV pool's pages, in use and free: decode's alone (it owns the pool; another worker
    exporting them at 0 would read as a full pool)."""

    pages_used: Gauge
    pages_free: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry) -> KvPoolMetrics:
        return cls(
            pages_used=Gauge(f"{PREFIX}kv_pages_used", "KV cache pages in use.", registry=registry),
            pages_free=Gauge(f"{PREFIX}kv_pages_free", "KV cache pages free.", registry=registry),
        )


def _control_refused(registry: CollectorRegistry) -> Counter:
    return Counter(
        f"{PREFIX}control_refused_total",
        "What a control-plane inbox refused: connections whose handshake failed (no or unknown keys), "
        "messages whose sender may not send them.",
        ["reason"],
        registry=registry,
    )


class RefusalCount:
    """Carries an inbox's running counts of refused connections and rejected messages
    (common/ipc/transport.py) into `counter` as reason="handshake" and reason="sender"."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self.seen = {"handshake": 0, "sender": 0}

    def sync(self, refused: int, rejected: int) -> None:
        for reason, total in (("handshake", refused), ("sender", rejected)):
            if total > self.seen[reason]:
                self.counter.labels(reason=reason).inc(total - self.seen[reason])
                self.seen[reason] = total


@dataclass(frozen=True)
class ExpertCacheMetrics:
    """The VRAM expert cache (decode) and the prefill arena, per layer where it matters."""

    hits: Counter
    misses: Counter
    evictions: Counter
    bypasses: Counter
    """Misses computed straight from host memory without insertion (admission filter, freeze)."""
    prefetches: Counter
    """Experts a lookahead copied into a slot ahead of their layer's step (`--lookahead`)."""
    prefetch_hits: Counter
    """Lookups served by a slot a lookahead filled (prefetch hits ÷ prefetches: how often a guess pays)."""
    hit_rate: Gauge
    """Per layer, over the worker's recent window; the Grafana heatmap reads it."""
    slots: Gauge
    """Cache slots assigned to each layer (they move with adaptive per-layer capacity)."""
    h2d_bytes: Counter
    """Bytes copied or read host → device for experts."""
    arena_loads: Counter
    """Experts loaded into the prefill arena."""
    lent_bytes: Gauge
    """Idle KV-pool and arena memory currently lent to the expert cache."""

    @classmethod
    def create(cls, registry: CollectorRegistry) -> ExpertCacheMetrics:
        def counter(name: str, doc: str) -> Counter:
            return Counter(f"{PREFIX}{name}", doc, ["layer"], registry=registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"{PREFIX}{name}", doc, ["layer"], registry=registry)

        return cls(
            hits=counter("expert_cache_hits_total", "Expert lookups served from the cache."),
            misses=counter("expert_cache_misses_total", "Expert lookups not in the cache."),
            evictions=counter("expert_cache_evictions_total", "Experts evicted from the cache."),
            bypasses=counter(
                "expert_cache_bypasses_total", "Misses computed from host memory, not inserted."
            ),
            prefetches=counter("expert_cache_prefetches_total", "Experts copied in ahead by a lookahead."),
            prefetch_hits=counter(
                "expert_cache_prefetch_hits_total", "Lookups served by a slot a lookahead filled."
            ),
            hit_rate=gauge("expert_cache_hit_rate", "Recent expert cache hit rate."),
            slots=gauge("expert_cache_slots", "Expert cache slots held by the layer."),
            h2d_bytes=Counter(
                f"{PREFIX}expert_h2d_bytes_total", "Expert bytes moved host to device.", registry=registry
            ),
            arena_loads=Counter(
                f"{PREFIX}arena_loads_total", "Experts loaded into the prefill arena.", registry=registry
            ),
            lent_bytes=Gauge(
                f"{PREFIX}expert_cache_lent_bytes",
                "Idle memory lent to the expert cache.",
                registry=registry,
            ),
        )


@dataclass(frozen=True)
class EncoderMetrics:
    """The vision encoder: images in, embedding rows out, and the rows of its one buffer lent to prefill
    (moved from EncoderCore's plain counters by `common.workers.encoder_metrics.EncoderMetricsExporter`)."""

    images_encoded: Counter
    """Images whose embeddings were written (a refused request's images are not counted)."""
    image_tokens: Counter
    """Embedding rows written: the image tokens prefill gets (images × tokens: the encoder's real load)."""
    encode_seconds: Histogram
    """One request's tower pass over all its images, with the copy into the buffer (on a GPU, synchronised):
    what an image prompt waits before its prefill can start."""
    requests_refused: Counter
    """Requests answered with an error, by reason: `decode` (an image does not decode), `too_large` (more rows
    than the whole buffer: its --rows) or `failed` (the tower pass raised)."""
    rows_lent: Gauge
    """Buffer rows lent to prefill now (sent, not yet taken): near capacity, image requests queue for rows."""
    rows_capacity: Gauge
    """The buffer's rows (--rows): the bound `rows_lent` is read against."""

    @classmethod
    def create(cls, registry: CollectorRegistry) -> EncoderMetrics:
        return cls(
            images_encoded=Counter(
                f"{PREFIX}images_encoded_total", "Images whose embeddings were written.", registry=registry
            ),
            image_tokens=Counter(
                f"{PREFIX}image_tokens_total", "Embedding rows (image tokens) written.", registry=registry
            ),
            encode_seconds=Histogram(
                f"{PREFIX}image_encode_seconds",
                "Time of one request's vision tower pass over its images, with the copy into the buffer.",
                buckets=ENCODE_BUCKETS,
                registry=registry,
            ),
            requests_refused=Counter(
                f"{PREFIX}image_requests_refused_total",
                "Image requests answered with an error, by reason (decode, too_large, failed).",
                ["reason"],
                registry=registry,
            ),
            rows_lent=Gauge(
                f"{PREFIX}encoder_rows_lent", "Buffer rows lent to prefill, not yet taken.", registry=registry
            ),
            rows_capacity=Gauge(
                f"{PREFIX}encoder_rows_capacity", "Rows of the encoder's output buffer.", registry=registry
            ),
        )
