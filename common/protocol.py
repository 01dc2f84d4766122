"""Every message that crosses a socket: msgspec structs, one tagged union, no pickle anywhere.

Topology (docs/ARCHITECTURE.md, Messages): each service binds one PULL inbox and the others PUSH to it.
- router  → prefill: `Generate`, `Abort`            router → decode: `Abort`
- router  → encoder: `Encode`, `Abort`             encoder → prefill: `ImagesEncoded`
- prefill → encoder: `ImagesTaken`
- prefill → decode:  `AllocState`, `PrefillDone`, `Thaw`, `ReleaseState`
- prefill → decode:  `WantExports` (at prefill's start)
- decode  → prefill: `StateGranted`, `Exports` (at decode's start and on `WantExports`)
- prefill, decode, encoder → router: `Tokens`, `Ready`, `Heartbeat`; launcher → router: `ServiceDown`
Every request is named by the router's `rid`; a `Tokens` event with `finish_reason` set is its last.
With keys (common/ipc/keys.py) an inbox knows each message's sender: it takes only what `SENDERS` allows.
"""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, frozen=True):
    """How one request picks its tokens and when it stops (also its wire form: a msgspec struct)."""

    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or negative = all."""
    seed: int | None = None
    """Makes sampling reproducible; None draws one at admission."""
    max_tokens: int = 16
    """Most tokens to generate."""
    ignore_eos: bool = False
    """Keep generating past end-of-sequence tokens."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra tokens that end the request."""
    logprobs: int | None = None
    """None: no log-probabilities. k (0..MAX_TOP_LOGPROBS): each generated token's, and those of the k most
    likely tokens at its position (`logprobs_of`)."""
    min_p: float = 0.0
    """Drop the tokens less likely than min_p times the most likely one (after temperature); 0 = off."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the request has generated (OpenAI's, -2..2)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once for each time the request has generated it (OpenAI's, -2..2)."""
    repetition_penalty: float = 1.0
    """Divides the positive logits, and multiplies the negative ones, of the tokens in the prompt or
    generated (HF transformers' and vLLM's); 1 = off."""
    min_tokens: int = 0
    """The end-of-sequence and stop tokens cannot be sampled before the request has this many tokens."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits (OpenAI's, -100..100: ±100 bans or forces a token)."""
    structure: str = ""
    """The JSON schema the text must follow, as JSON text (common/sampling/structured.py); empty: free
    text."""
    structure_after: int = -1
    """The token after which `structure` holds (the end of a reasoning block the chat template opened:
    the model thinks freely first); -1: from the first token."""
    prompt_logprobs: int | None = None
    """None: none. k (0..MAX_TOP_LOGPROBS): each prompt token's log-probability after the tokens before it
    (the first has none), and the k most likely tokens' at its position."""

    @property
    def penalized(self) -> bool:
        """Whether the request's logits depend on the tokens it has seen (its row of counts)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


MAX_TOP_LOGPROBS = 20
"""The most alternatives a request may ask log-probabilities of (OpenAI's top_logprobs bound)."""


class Sibling(msgspec.Struct, frozen=True, array_like=True):
    """A further choice of a prompt (`Generate.siblings`): its request id and its sampling seed."""

    rid: str
    seed: int | None
    """None: prefill draws one."""


class Generate(msgspec.Struct, frozen=True, tag=True):
    """router → prefill: run this prompt, then hand it to decode."""

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    arrival: float
    """time.time() when the router accepted it (TTFT is measured from here)."""
    images: int = 0
    """Images in the prompt (each a run of the model's image token): prefill runs it only once their
    embeddings came (`ImagesEncoded`)."""
    siblings: list[Sibling] = []
    """Further choices of this prompt (a request's `n`), each a request of its own from its first token on,
    which differ from this one in their seeds only: the prompt is prefilled once, each samples its first
    token from its logits, and decode copies the prompt's state to each."""


class Encode(msgspec.Struct, frozen=True, tag=True):
    """router → encoder: the images of `rid`'s prompt, in the prompt's order; their embeddings go to the
    prefill worker named `prefill` (the request's pair)."""

    rid: str
    images: list[bytes]
    """Each image's file (PNG, JPEG, WebP or GIF), as its data URL carried it."""
    prefill: str


class ImagesTaken(msgspec.Struct, frozen=True, tag=True):
    """prefill → encoder: `rid`'s embedding rows are copied, or no longer wanted: the encoder reuses them."""

    rid: str


class Abort(msgspec.Struct, frozen=True, tag=True):
    """router → every worker: forget `rid` and free what it holds (no event is sent back)."""

    rid: str


class AllocState(msgspec.Struct, frozen=True, tag=True):
    """prefill → decode: reserve a state slot and KV pages for `num_tokens` tokens of `rid`."""

    rid: str
    num_tokens: int
    siblings: list[str] = []
    """`Generate.siblings`' request ids: each takes a copy of `rid`'s state once it is prefilled, so decode
    grants them together with it, a lane and `num_tokens` of pages each (kept by decode: prefill writes
    `rid`'s state only)."""


class SiblingStart(msgspec.Struct, frozen=True, array_like=True):
    """A sibling that goes on from its first token (`PrefillDone.siblings`)."""

    rid: str
    first_token: int
    seed: int


class StateGranted(msgspec.Struct, frozen=True, tag=True):
    """decode → prefill: the slot and pages of `rid` (empty `error` on success)."""

    rid: str
    slot: int
    pages: list[int]
    error: str = ""


class PrefillDone(msgspec.Struct, frozen=True, tag=True):
    """prefill → decode: `rid`'s state is written for `num_cached` tokens; decode it from `first_token`."""

    rid: str
    prompt_len: int
    num_cached: int
    first_token: int
    sampling: SamplingParams
    seed: int
    """The seed actually used (drawn by prefill when the request named none)."""
    arrival: float
    slot: int
    pages: list[int]
    routing: bytes = b""
    """The prompt's routing as expert-cache request statistics (`CacheTables.statistics()`, fp32 [L, 2E + 2],
    raw bytes), for decode to add to its own; empty for a model without offloaded experts."""
    rope_delta: int = 0
    """What the rotary positions of the tokens after the prompt add to their positions (a prompt with images:
    `SequenceState.rope_delta`)."""
    prompt_ids: list[int] = []
    """The prompt, for a request whose repetition penalty reads it (`SamplingParams.repetition_penalty`);
    empty otherwise."""
    siblings: list[SiblingStart] = []
    """`rid`'s siblings that go on from their first token: decode copies the prompt's state to each (those
    not listed ended at their first token or were aborted: their states are freed)."""
    finished: bool = False
    """`rid` itself ended at its first token: its state is only its siblings' source, freed once copied."""


class ReleaseState(msgspec.Struct, frozen=True, tag=True):
    """prefill → decode: free `rid`'s slot and pages (the request ended before decode took it over)."""

    rid: str


class Thaw(msgspec.Struct, frozen=True, tag=True):
    """prefill → decode: the expert-cache freeze of `holder` (taken when decode granted its state: decode
    stops inserting and evicting while a prefill reads the cache in place) is over."""

    holder: str


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """One generated token's log-probability under the model, and the most likely tokens' at its position
    (`SamplingParams.logprobs` of them, best first; common/sampling/sampler.py's logprobs_of)."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class Tokens(msgspec.Struct, frozen=True, tag=True):
    """worker → router: new token ids of `rid`; `finish_reason` (stop | length | abort | error) ends it."""

    rid: str
    token_ids: list[int]
    finish_reason: str | None = None
    error: str = ""
    prompt_tokens: int = 0
    index: int = 0
    """Position of token_ids[0] among the request's generated tokens (prefill sends the first, decode the
    rest; they travel on different connections, so the router orders them by this)."""
    logprobs: list[TokenLogprobs] = []
    """One for each of token_ids when the request asked for them (`SamplingParams.logprobs`), else none."""
    prompt_logprobs: list[TokenLogprobs] = []
    """In prefill's event, when the request asked (`SamplingParams.prompt_logprobs`): one for each prompt
    token after the first."""
    refused: bool = False
    """With finish_reason `error`: the request itself cannot be served (its grammar is over the workers'
    budgets), not a worker's failure: the router answers 400, not 500."""


class SharedTensor(msgspec.Struct, frozen=True):
    """A tensor another process can map (common.ipc.tensors): CUDA IPC handle or shared-memory segment."""

    kind: str
    """"cuda", "shm" or "aliased" (memory mapped twice, common/ipc/aliased.py: KV lending's pools)."""
    handle: bytes
    """cudaIpcMemHandle bytes ("cuda") or the segment's name, utf-8 ("shm")."""
    offset: int
    """Byte offset of the tensor in the allocation."""
    nbytes: int
    """Size of the allocation the handle names."""
    dtype: str
    shape: list[int]
    stride: list[int]
    device: int
    """CUDA device index (−1 on the host)."""
    pieces: list[list[int]] = []
    """"aliased" only: the range's mappings, [offset, length, source id, offset in the source] each (its
    allocations come from the fd server whose socket path is `handle`; common/ipc/aliased.py)."""


class ImagesEncoded(msgspec.Struct, frozen=True, tag=True):
    """encoder → prefill: rows [start, start + rows) of `buffer` ([capacity, text hidden], exported once by
    the encoder) hold the embeddings of `rid`'s image tokens, the images' in order; `grids` are the images'
    patch grids (t, h, w). The rows are lent until prefill sends `ImagesTaken`. A non-empty `error`: the
    images could not be encoded (no rows)."""

    rid: str
    buffer: SharedTensor | None
    start: int
    rows: int
    grids: list[list[int]]
    error: str = ""
    data: bytes = b""
    """The rows themselves ([rows, text hidden] in `dtype`, raw bytes) instead of `buffer`'s: an encoder on
    another machine than the prefill worker (`--inline`); nothing to give back."""
    dtype: str = ""


class Exports(msgspec.Struct, frozen=True, tag=True):
    """decode → prefill: everything decode owns that prefill maps instead of copying."""

    epoch: int
    """Bumped on each decode start; prefill remaps when it changes."""
    tensors: dict[str, SharedTensor]
    """Resident weights by parameter name, state pools as `state.{layer}.{name}`, cache tables and slots as
    `cache.{name}`."""
    page_size: int
    max_context: int
    expert_store: str = ""
    """Path of the host expert store's file (offloaded experts; prefill maps it too), else empty."""
    expert_format: str = ""
    arena_row: int = -1
    """With `--lend-arena`: the first row of prefill's arena in `cache.pool.*` (a spare row, then two buffers
    of E rows; decode's bank, lent to its cache only while no prefill holds a freeze); −1: prefill allocates
    its own."""


class WantExports(msgspec.Struct, frozen=True, tag=True):
    """prefill → decode, at prefill's start: send me `Exports` (decode may have started first)."""

    pid: int


class Ready(msgspec.Struct, frozen=True, tag=True):
    """worker → router: started and able to take `capacity` running requests."""

    service: str
    pid: int
    capacity: int
    metrics_url: str = ""
    max_context: int = 0
    """The longest prompt + completion it holds (the model's limit may be below the one asked for); 0:
    none of its own."""
    instance: str = ""
    """A random id of this process's start: with `pid`, tells a restarted worker from the one before it where
    pids repeat (each container starts its process with the same pid; two hosts may share one)."""
    image_tokens: int = 0
    """The encoder: the most image tokens one request's images may take (what its buffer holds); 0: none."""


class Heartbeat(msgspec.Struct, frozen=True, tag=True):
    """worker → router, every second (from a thread of its own): alive, with its load, and what its `Ready`
    said (so that a restarted router knows a worker's capacity and context without a `Ready` of its own)."""

    service: str
    pid: int
    running: int = 0
    waiting: int = 0
    capacity: int = 0
    max_context: int = 0
    instance: str = ""
    """As in `Ready`."""
    image_tokens: int = 0
    """As in `Ready`."""
    loop_s: float = 0.0
    """Seconds since the worker's loop last came round (the beats come from a thread of their own: a worker
    heard but whose loop is silent past the router's stall timeout is hung); 0 during work that is no
    hang."""


class ServiceDown(msgspec.Struct, frozen=True, tag=True):
    """launcher → router: worker `pid` of `service` exited (`/health` turns 503 and the requests in flight end
    with an error now, not when the restarted worker says `Ready`)."""

    service: str
    pid: int
    exit_code: int


class PairMoved(msgspec.Struct, frozen=True, tag=True):
    """launcher → router, encoder: pair `index`'s workers were started again at new inboxes (a Ray pair's host
    replaced on another node): connect there; what the pair held has failed."""

    index: int
    prefill: str
    decode: str


Message = (
    Generate
    | Encode
    | ImagesEncoded
    | ImagesTaken
    | Abort
    | AllocState
    | StateGranted
    | PrefillDone
    | ReleaseState
    | Thaw
    | Tokens
    | Exports
    | WantExports
    | Ready
    | Heartbeat
    | ServiceDown
    | PairMoved
)

WORKER_ROLES = ("prefill", "decode", "encoder")
SENDERS: dict[type, tuple[str, ...]] = {
    Generate: ("router",),
    Encode: ("router",),
    Abort: ("router",),
    ImagesEncoded: ("encoder",),
    ImagesTaken: ("prefill",),
    AllocState: ("prefill",),
    PrefillDone: ("prefill",),
    ReleaseState: ("prefill",),
    Thaw: ("prefill",),
    WantExports: ("prefill",),
    StateGranted: ("decode",),
    Exports: ("decode",),
    Tokens: WORKER_ROLES,
    Ready: WORKER_ROLES,
    Heartbeat: WORKER_ROLES,
    ServiceDown: ("launcher",),
    PairMoved: ("launcher",),
}
"""The roles that may send each message (the topology above): an inbox that knows a message's sender
(common/ipc/keys.py) drops one from any other (`may_send`)."""


def role_of(service: str) -> str:
    """The role of the service named `service`: `prefill-2` is a prefill worker (`pair_names`)."""
    return service.split("-", 1)[0]


def may_send(msg: Message, sender: str) -> bool:
    """Whether the service named `sender` may send `msg`: its role may send messages of its kind, and a
    worker's `Ready` and `Heartbeat` speak for the sender itself only."""
    if isinstance(msg, Ready | Heartbeat) and msg.service != sender:
        return False
    return role_of(sender) in SENDERS.get(type(msg), ())


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(frame: bytes) -> Message:
    """Raises msgspec.DecodeError (a ValidationError for a well-formed frame of the wrong shape)."""
    return _decoder.decode(frame)
