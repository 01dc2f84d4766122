"""The router's configuration: one frozen dataclass, built by `main` from the command line or by a test."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from common.config import GRAMMAR_MAX_BYTES
from common.ipc.keys import ControlKeys

BODY_ALLOWANCE_BYTES = 2**20
"""What a request body may hold beside its prompt's text (its other fields, JSON's escapes), where no
encoder runs (`RouterConfig.prompt_bytes_per_token`)."""


@dataclass(frozen=True)
class WorkerPair:
    """The inboxes of one prefill worker and the decode worker it hands its requests to (its service names:
    `common.ipc.transport.pair_names` of its place in `RouterConfig.pairs`)."""

    prefill: str
    """The prefill worker's inbox (`Generate`, `Abort`)."""
    decode: str
    """The decode worker's inbox (`Abort`)."""


@dataclass(frozen=True)
class RouterConfig:
    """Everything the router needs; addresses are ZeroMQ endpoints (`ipc://...` or `tcp://host:port`)."""

    model_dir: Path
    """Local HF model directory: its tokenizer, chat template and config.json (for the context length)."""
    inbox: str
    """Address the router binds its PULL inbox on; workers push `Tokens`, `Ready` and `Heartbeat` there."""
    pairs: tuple[WorkerPair, ...]
    """The prefill/decode pairs requests are spread over (one a GPU, or a machine): each request runs on
    one pair, and a pair's failure fails only its requests. The router serves while one pair is up."""
    served_model_name: str | None = None
    """The model id clients name; None = the model directory's name."""
    encoder: str = ""
    """The vision encoder's inbox (`Encode`, `Abort`): chats may carry images (a model with a vision tower);
    empty: none (an image is a 400)."""
    host: str = "127.0.0.1"
    """Interface the HTTP server binds (loopback unless told otherwise)."""
    port: int = 8000
    """HTTP port of the API (and of `/metrics`)."""
    max_running: int = 0
    """Most requests in flight to the workers; 0 = the capacity the pairs that are up announced in `Ready`
    (a pair's: the smaller of its two workers')."""
    max_queue: int = 256
    """Most requests waiting in the router's FIFO behind the running ones; beyond it requests get 429."""
    max_context: int | None = None
    """Longest prompt + completion in tokens; None = config.json's `max_position_embeddings`."""
    max_request_bytes: int = 64 * 2**20
    """Largest request body read (a 413 beyond it, before more of it is held in memory): far above the
    longest context's text and a chat's images (base64, a few MB each)."""
    prompt_bytes_per_token: int = 16
    """A prompt's text (a chat's rendered through its template, a completion's each) may hold at most
    `max_context` times this many UTF-8 bytes: a 400 beyond, before it is tokenized (far more than any
    tokenizer packs into a token). Without an encoder, the request body is held to that plus
    `grammar_max_bytes` plus BODY_ALLOWANCE_BYTES as it is read (below `max_request_bytes`)."""
    max_image_pixels: int = 2**25
    """Most pixels (width x height, read from the file's header before it is decoded) of one image: a 400
    beyond."""
    max_request_pixels: int = 2**27
    """Most pixels of all the images of one request together: a 400 beyond."""
    grammar_max_bytes: int = GRAMMAR_MAX_BYTES
    """Largest structured output's form (a JSON schema's, or a forced call's) served: a larger one is a 400
    before its grammar is built (the workers' `WorkerConfig.grammar_max_bytes`, the same)."""
    api_key: str | None = None
    """When set, `/v1/*` and `/metrics` (the API port's and `metrics_port`'s) require `Authorization: Bearer
    <api_key>` (401 otherwise); `/health` answers anyone, but without the key only its status."""
    metrics_port: int | None = None
    """Also serve the router's metrics on this port (a Prometheus target of its own); None = only on
    the API port's `/metrics`."""
    metrics_urls: Mapping[str, str] = field(default_factory=dict)
    """Each worker's metrics URL by service name, reported by `/health` (a worker's `Ready` may name its
    own, which wins)."""
    restarts: Mapping[str, int] = field(default_factory=dict)
    """Restarts so far by service name, the router's own among them, as its launcher counted them before
    starting this router (`/health` goes on from these: a restarted router does not count from 0)."""
    heartbeat_timeout_s: float = 5.0
    """A worker whose last `Ready`/`Heartbeat` is older than this is down (503 while no pair is up, until it
    is heard again); a later heartbeat is logged and counted as late. Workers beat every second from a
    thread of their own: only a dead or frozen process misses this."""
    stall_timeout_s: float = 120.0
    """A worker whose loop has not come round this long (its heartbeats' `loop_s`, or no heartbeat at all) is
    hung: the requests in flight end with an error event (the launcher also kills it, and restarts it).
    Far above the longest step (a prefill chunk: about a second), below any client's patience; 0 = never."""
    event_gap_timeout_s: float = 10.0
    """A request whose next event (by `Tokens.index`) is still missing this long after a later one came lost
    it (a worker drops events while the router's queue is full): it ends with an error event, and its
    workers abort it, rather than wait for good. A gap shows only once a later event comes: a lost last
    event is the worker's to report (`WorkerShell.send` fails a request it drops events of). Far above the
    skew between prefill's and decode's connections (milliseconds); 0 = never."""

    control_keys: ControlKeys | None = field(default=None, repr=False)
    """The router's CurveZMQ keys (common/ipc/keys.py; from the launcher, in the environment): its inbox
    admits only the known services and takes each message only from a role that may send it. None: no
    CurveZMQ (ipc:// sockets in a private run directory)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_dir", Path(self.model_dir))
        object.__setattr__(self, "metrics_urls", MappingProxyType(dict(self.metrics_urls)))
        object.__setattr__(self, "restarts", MappingProxyType(dict(self.restarts)))
        object.__setattr__(self, "pairs", tuple(self.pairs))
        if not self.pairs:
            raise ValueError("the router needs at least one prefill/decode pair")
        if self.max_running < 0 or self.max_queue < 0:
            raise ValueError("max_running and max_queue must not be negative")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError(f"max_context must be at least 2, got {self.max_context}")
        if self.heartbeat_timeout_s <= 0:
            raise ValueError("heartbeat_timeout_s must be positive")
        if self.stall_timeout_s < 0:
            raise ValueError("stall_timeout_s must not be negative")
        if self.max_request_bytes < 1:
            raise ValueError("max_request_bytes must be positive")
        if min(self.prompt_bytes_per_token, self.max_image_pixels, self.max_request_pixels) < 1:
            raise ValueError(
                "prompt_bytes_per_token, max_image_pixels and max_request_pixels must be positive"
            )
        if self.grammar_max_bytes < 0:
            raise ValueError("grammar_max_bytes must not be negative")
        if self.event_gap_timeout_s < 0:
            raise ValueError("event_gap_timeout_s must not be negative")

    @property
    def model_name(self) -> str:
        """The id clients use for the served model."""
        return self.served_model_name or self.model_dir.name


def model_max_context(model_dir: Path) -> int:
    """`max_position_embeddings` of the model's config.json (or of its `text_config`, for VL models).

    Read directly rather than through the model registry, so the router never imports torch.
    """
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    for section in (config, config.get("text_config") or {}):
        value = section.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"{path} has no max_position_embeddings; pass max_context explicitly")
