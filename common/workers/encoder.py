"""EncoderCore: the vision encoder worker's library half, steppable in-process.

The encoder turns a request's images into the embeddings its image tokens take (`ImageEncoder`) and lends
them to the request's prefill worker in place: every result is written into one output buffer
[capacity rows, text hidden], allocated and exported once at start (CUDA IPC never recycles an exported
block, so a buffer per request would leak; common/ipc.py), and `ImagesEncoded` names a range of its rows.
The rows stay lent until prefill says `ImagesTaken` (it copied them) or the router says `Abort`.

Requests are served one at a time in arrival order: the head's rows are counted before its tower pass (from
the images' sizes), and while the buffer has no contiguous range that large the head waits, and the queue with
it (FIFO: a big request is not starved by small ones behind it).
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common import ipc
from common.image_encoder import EncodedImage, ImageEncoder
from common.images import decode_image, image_grid
from common.protocol import Encode, ImagesEncoded, Message

Outgoing = list[tuple[str, Message]]
"""Messages to send, each with its destination service (the prefill worker an `Encode` named)."""

log = logging.getLogger(__name__)


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


class EncoderCore:
    """Images to embedding rows in one exported buffer, lent to prefill workers until they are taken.

    Contract: `submit` queues an `Encode` (a second one for a rid it holds is ignored); each `step` serves at
    most the head of the queue and returns what to send: `ImagesEncoded` with rows to the prefill worker the
    request named, or `ImagesEncoded` with an `error` (and no rows) for images that do not decode, that need
    more rows than the whole buffer, or whose tower pass raised. `taken` and `abort` give a request's rows
    back (or drop it from the queue); rows that have been sent are not written again until then. On CUDA the
    rows are written (synchronised) before `step` returns, so the message may be sent at once.
    """

    def __init__(self, encoder: ImageEncoder, capacity_rows: int, dtype: torch.dtype | None = None) -> None:
        if capacity_rows < 1:
            raise ValueError(f"the encoder's buffer needs at least 1 row, not {capacity_rows}")
        self.encoder = encoder
        hidden = encoder.tower.cfg.out_hidden_size
        self.buffer = ipc.shared_empty(
            (capacity_rows, hidden), dtype or encoder.dtype, encoder.device
        )  # [capacity, H]: shared memory on the CPU, a CUDA block on a GPU
        self.shared = ipc.export_tensor(self.buffer)
        """The buffer's one export, in every `ImagesEncoded` (importers map it once)."""
        self.ranges = RowRanges(capacity_rows)
        self.queue: deque[Queued] = deque()
        self.lent: dict[str, tuple[int, int]] = {}
        """rid → (start, rows) of rows sent and not yet taken."""

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        capacity_rows: int,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
    ) -> EncoderCore:
        """The core over a model directory's vision tower (ValueError/OSError for a model without one)."""
        return cls(ImageEncoder(model_dir, dtype, device), capacity_rows)

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
        """Serve the head of the queue: refuse it, encode it into rows, or (rows short) leave it waiting."""
        if not self.queue:
            return []
        head = self.queue[0]
        if head.images is None:
            error = self._prepare(head)
            if error:
                self.queue.popleft()
                return [self._refusal(head.msg, error)]
        start = self.ranges.allocate(head.rows)
        if start is None:
            return []
        self.queue.popleft()
        try:
            self._write(start, head.rows, self.encoder.encode(head.images))
        except Exception as exc:  # a bad request fails alone, not the worker
            log.exception("encoding the images of %s failed", head.msg.rid)
            self.ranges.release(start, head.rows)
            return [self._refusal(head.msg, f"encoding the images failed: {exc}")]
        self.lent[head.msg.rid] = (start, head.rows)
        grids = [list(g) for g in head.grids]
        return [(head.msg.prefill, ImagesEncoded(head.msg.rid, self.shared, start, head.rows, grids))]

    def _prepare(self, queued: Queued) -> str:
        """Decode the images of the head and count its rows; the error that refuses it, or ""."""
        images, count = [], len(queued.msg.images)
        for i, raw in enumerate(queued.msg.images):
            try:
                images.append(decode_image(raw))
                queued.grids.append(image_grid(images[-1], self.encoder.processing))
            except Exception as exc:  # whatever fails in a request's own images refuses that request
                return f"image {i + 1} of {count}: {exc}"
        queued.images = images
        queued.rows = sum(self.encoder.tokens(g) for g in queued.grids)
        if queued.rows > self.capacity:
            return (
                f"the images need {queued.rows} embedding rows, more than the encoder's whole buffer holds "
                f"({self.capacity} rows: its --rows)"
            )
        return ""

    def _write(self, start: int, rows: int, encoded: list[EncodedImage]) -> None:
        """Copy a request's embeddings into rows [start, start + rows), cast to the buffer's dtype."""
        if not encoded:
            return
        embeddings = torch.cat([e.embeddings for e in encoded])  # [rows, H]
        if embeddings.shape[0] != rows:
            raise ValueError(f"the tower gave {embeddings.shape[0]} rows for {rows} image tokens")
        self.buffer[start : start + rows].copy_(embeddings)
        if self.buffer.is_cuda:  # the importer reads once the message is there: the copy must be done
            torch.cuda.synchronize(self.buffer.device)

    @staticmethod
    def _refusal(msg: Encode, error: str) -> tuple[str, Message]:
        log.warning("refusing the images of %s: %s", msg.rid, error)
        return msg.prefill, ImagesEncoded(msg.rid, None, 0, 0, [], error=error)
