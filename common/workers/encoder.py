"""EncoderCore: the vision encoder worker's library half, steppable in-process.

The encoder turns a request's images into the embeddings its image tokens take (`ImageEncoder`) and lends
them to the request's prefill worker in place: every result is written into one output buffer
[capacity rows, text hidden], allocated and exported once at start, and `ImagesEncoded` names a range of its
rows. The buffer is host shared memory wherever the tower runs, so a prefill worker maps it whichever GPU it
sees (a CUDA IPC export would need both to number the GPUs alike, and is never recycled); the rows are a few
MB a request. The rows stay lent until prefill says `ImagesTaken` (it copied them) or the router says
`Abort`. Where prefill cannot map the buffer (another machine: `inline`), the rows travel in the message.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.ipc import tensors as ipc
from common.protocol import Encode, ImagesEncoded, Message
from common.vision.encoder import EncodedImage, ImageEncoder
from common.vision.images import decode_image, image_grid

Outgoing = list[tuple[str, Message]]
"""Messages to send, each with its destination service (the prefill worker an `Encode` named)."""

log = logging.getLogger(__name__)

REFUSALS = ("decode", "too_large", "failed")
"""Why a request gets an error and no rows: an image that does not decode, more rows than the whole buffer,
a tower pass that raised (`EncoderStats.refused`'s keys)."""
RECENT_PASSES = 256
"""Tower passes whose seconds `EncoderStats.pass_seconds` keeps: far more than one heartbeat's worth."""


class RowRanges:
    """First-fit allocation of contiguous row ranges in [0, capacity); a freed range coalesces with free
    neighbours, so the buffer does not fragment into pieces too small for a big request."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free: list[tuple[int, int]] = [(0, capacity)] if capacity else []
        """(start, rows) of each free range: sorted by start, disjoint, never adjacent."""

    @property
    def free_rows(self) -> int:
        return sum(rows for _, rows in self.free)

    def fits(self, rows: int) -> bool:
        """Whether `allocate(rows)` would succeed now."""
        return rows == 0 or any(length >= rows for _, length in self.free)

    def allocate(self, rows: int) -> int | None:
        """The start of `rows` contiguous rows now held (the lowest range that fits); None when none does.
        Zero rows take nothing (start 0)."""
        if rows == 0:
            return 0
        for i, (start, length) in enumerate(self.free):
            if length >= rows:
                if length == rows:
                    del self.free[i]
                else:
                    self.free[i] = (start + rows, length - rows)
                return start
        return None

    def release(self, start: int, rows: int) -> None:
        """Free rows [start, start + rows); ValueError for rows outside the buffer or free already."""
        if rows == 0:
            return
        if start < 0 or start + rows > self.capacity:
            raise ValueError(f"rows [{start}, {start + rows}) are outside [0, {self.capacity})")
        i = bisect.bisect_left(self.free, start, key=lambda r: r[0])
        before = self.free[i - 1] if i > 0 else None
        after = self.free[i] if i < len(self.free) else None
        if (before and sum(before) > start) or (after and after[0] < start + rows):
            raise ValueError(f"rows [{start}, {start + rows}) are free already")
        if before and sum(before) == start:  # merge with the range below
            start, rows, i = before[0], before[1] + rows, i - 1
            del self.free[i]
        if after and after[0] == start + rows:  # and with the range above
            rows += after[1]
            del self.free[i]
        self.free.insert(i, (start, rows))


@dataclass
class Queued:
    """A request waiting for its tower pass: its images decoded and its rows counted once it is the head."""

    msg: Encode
    images: list | None = None
    """RGB PIL images (None until the request reaches the head of the queue)."""
    grids: list[tuple[int, int, int]] = field(default_factory=list)
    rows: int = 0
    """The image tokens of all its images: rows of the buffer it takes."""


@dataclass
class EncoderStats:
    """What a core has done since it started, as plain numbers that only grow: the service moves them into
    Prometheus (common/workers/encoder_metrics.py) by difference, so the core knows nothing of metrics and is
    stepped bare in tests."""

    images: int = 0
    """Images whose embeddings were written."""
    rows: int = 0
    """Embedding rows written (the image tokens of those images)."""
    passes: int = 0
    """Tower passes that wrote their rows: one a request with images that was not refused."""
    pass_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_PASSES))
    """Seconds of the latest passes (the tower and the copy of its rows), oldest first: a reader takes the
    `passes - seen` newest as its new ones, so it must read more often than every RECENT_PASSES passes."""
    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REFUSALS, 0))
    """Requests answered with an error, by reason (REFUSALS)."""


class EncoderCore:
    """Images to embedding rows in one exported buffer, lent to prefill workers until they are taken.

    Contract: `submit` queues an `Encode` (a second one for a rid it holds is ignored); each `step` serves at
    most the head of the queue and returns what to send: `ImagesEncoded` with rows to the prefill worker the
    request named, or `ImagesEncoded` with an `error` (and no rows) for images that do not decode, that need
    more rows than the whole buffer, or whose tower pass raised. `taken` and `abort` give a request's rows
    back (or drop it from the queue); rows that have been sent are not written again until then. On CUDA the
    rows are written (synchronised) before `step` returns, so the message may be sent at once.
    """

    def __init__(
        self,
        encoder: ImageEncoder,
        capacity_rows: int,
        dtype: torch.dtype | None = None,
        inline: bool = False,
    ) -> None:
        """`inline`: send the rows in each `ImagesEncoded` (prefill on other machines); no buffer is kept,
        and `capacity_rows` only bounds a request."""
        if capacity_rows < 1:
            raise ValueError(f"the encoder's buffer needs at least 1 row, not {capacity_rows}")
        self.encoder, self.inline = encoder, inline
        self.dtype = dtype or encoder.dtype
        hidden = encoder.tower.cfg.out_hidden_size
        self.buffer = None if inline else ipc.shared_empty((capacity_rows, hidden), self.dtype)
        """[capacity, H] in host shared memory (None: `inline`)."""
        self.shared = None if self.buffer is None else ipc.export_tensor(self.buffer)
        """The buffer's one export, in every `ImagesEncoded` (importers map it once)."""
        self.ranges = RowRanges(capacity_rows)
        self.queue: deque[Queued] = deque()
        self.lent: dict[str, tuple[int, int]] = {}
        """rid → (start, rows) of rows sent and not yet taken."""
        self.stats = EncoderStats()

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        capacity_rows: int,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        inline: bool = False,
    ) -> EncoderCore:
        """The core over a model directory's vision tower (ValueError/OSError for a model without one)."""
        return cls(ImageEncoder(model_dir, dtype, device), capacity_rows, inline=inline)

    @property
    def capacity(self) -> int:
        return self.ranges.capacity

    @property
    def busy(self) -> bool:
        """Whether `step` has work it can do now (not a head waiting for rows: only a message frees them)."""
        if not self.queue:
            return False
        head = self.queue[0]
        return head.images is None or self.ranges.fits(head.rows)

    @property
    def running(self) -> int:
        """Requests whose rows are lent."""
        return len(self.lent)

    @property
    def waiting(self) -> int:
        return len(self.queue)

    @property
    def rows_lent(self) -> int:
        """Buffer rows held by the requests whose rows are lent (the rows the queue's head may wait for)."""
        return sum(rows for _, rows in self.lent.values())

    def submit(self, msg: Encode) -> None:
        """Queue `msg` behind the others; nothing is sent until `step` serves it."""
        if msg.rid in self.lent or any(q.msg.rid == msg.rid for q in self.queue):
            log.warning("ignoring a second Encode for %s", msg.rid)  # the router's ids are unique: a resend
            return
        self.queue.append(Queued(msg))

    def taken(self, rid: str) -> None:
        """Prefill copied `rid`'s rows (or no longer wants them): they are free for the requests waiting."""
        if not self._forget(rid):
            log.info("ImagesTaken for %s, which holds no rows (aborted before)", rid)

    def abort(self, rid: str) -> None:
        """Forget `rid`: free its rows, or drop it from the queue (no message is sent for it)."""
        self._forget(rid)

    def _forget(self, rid: str) -> bool:
        if rid in self.lent:
            self.ranges.release(*self.lent.pop(rid))
            return True
        kept = deque(q for q in self.queue if q.msg.rid != rid)
        dropped = len(kept) < len(self.queue)
        self.queue = kept
        return dropped

    def step(self) -> Outgoing:
        """Serve the head of the queue: refuse it, encode it into rows, or (rows short) leave it waiting.

        Requests are served one at a time in arrival order: the head's rows are counted before its tower pass
        (from the images' sizes), and while the buffer has no contiguous range that large the head waits,
        and the queue with it (FIFO: a big request is not starved by small ones behind it)."""
        if not self.queue:
            return []
        head = self.queue[0]
        if head.images is None:
            refused = self._prepare(head)
            if refused:
                self.queue.popleft()
                return [self._refusal(head.msg, refused[1], reason=refused[0])]
        start = None if self.inline else self.ranges.allocate(head.rows)
        if start is None and not self.inline:
            return []
        self.queue.popleft()
        return [self._serve(head, start)]

    def _serve(self, head: Queued, start: int | None) -> tuple[str, Message]:
        """`head`'s tower pass, its rows written at `start` and lent, or (None: `inline`) in the message."""
        msg, began, images = head.msg, time.perf_counter(), head.images
        assert images is not None  # the head is prepared (`_prepare`)
        try:
            rows = self._embeddings(self.encoder.encode(images)).to(self.dtype)  # [N, H]
            if rows.shape[0] != head.rows:
                raise ValueError(f"the tower gave {rows.shape[0]} rows for {head.rows} image tokens")
        except Exception as exc:  # a bad request fails alone, not the worker
            log.exception("encoding the images of %s failed", msg.rid)
            if start is not None:
                self.ranges.release(start, head.rows)
            return self._refusal(msg, f"encoding the images failed: {exc}")
        grids = [list(g) for g in head.grids]
        if start is None:
            data = rows.cpu().contiguous().view(torch.uint8).numpy().tobytes()
            self._count(head, began)
            dtype = ipc.dtype_name(self.dtype)
            return msg.prefill, ImagesEncoded(msg.rid, None, 0, head.rows, grids, data=data, dtype=dtype)
        assert self.buffer is not None  # a start is given only where there is a buffer
        self.buffer[start : start + head.rows].copy_(rows)  # (from a GPU: done when copy_ returns)
        self._count(head, began)
        self.lent[msg.rid] = (start, head.rows)
        return msg.prefill, ImagesEncoded(msg.rid, self.shared, start, head.rows, grids)

    def _embeddings(self, encoded: list[EncodedImage]) -> torch.Tensor:
        """A request's images' embeddings as one [N, H] (none: [0, H])."""
        if not encoded:
            return torch.empty(0, self.encoder.tower.cfg.out_hidden_size, dtype=self.dtype)
        return torch.cat([e.embeddings for e in encoded])

    def _prepare(self, queued: Queued) -> tuple[str, str] | None:
        """Decode the images of the head and count its rows; the reason (REFUSALS) and the error that refuse
        it, or None."""
        images, count = [], len(queued.msg.images)
        for i, raw in enumerate(queued.msg.images):
            try:
                images.append(decode_image(raw))
                queued.grids.append(image_grid(images[-1], self.encoder.processing))
            except Exception as exc:  # whatever fails in a request's own images refuses that request
                return "decode", f"image {i + 1} of {count}: {exc}"
        queued.images = images
        queued.rows = sum(self.encoder.tokens(g) for g in queued.grids)
        if queued.rows > self.capacity:
            return "too_large", (
                f"the images need {queued.rows} embedding rows, more than the encoder's whole buffer holds "
                f"({self.capacity} rows: its --rows)"
            )
        return None

    def _count(self, served: Queued, began: float) -> None:
        """Add a request whose rows were written, its pass begun at `began` (perf_counter), to the stats; one
        without images made no tower pass to time."""
        images = served.images or []  # prepared: its images decoded
        self.stats.images += len(images)
        self.stats.rows += served.rows
        if images:
            self.stats.passes += 1
            self.stats.pass_seconds.append(time.perf_counter() - began)

    def _refusal(self, msg: Encode, error: str, reason: str = "failed") -> tuple[str, Message]:
        """The error reply to `msg`, counted under `reason` (REFUSALS; by default: a tower pass raised)."""
        log.warning("refusing the images of %s: %s", msg.rid, error)
        self.stats.refused[reason] += 1
        return msg.prefill, ImagesEncoded(msg.rid, None, 0, 0, [], error=error)
