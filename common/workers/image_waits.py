"""Prefill's side of the vision encoder: requests whose prompts have images wait for their embeddings.

The router sends a request's images to the encoder and the request to prefill at once, so either may come
first: `ImageWaits` keeps a request (`Generate` with `images`) until its `ImagesEncoded` came, and the
embeddings until their request came, then hands the request on with what its prompt's images change in its
passes (`PromptImages` and the rotary delta: common/model/qwen4_exp/positions.py). The encoder lends its rows
until they are copied: every `ImagesEncoded` is answered with `ImagesTaken` at once, whatever became of its
request.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from common.ipc import tensors as ipc
from common.kv.state import PromptImages
from common.model.qwen4_exp.positions import ImageTokens, prompt_images
from common.protocol import Generate, ImagesEncoded, ImagesTaken, Message, SharedTensor, Tokens

log = logging.getLogger(__name__)

FORGOTTEN = 1024
"""Aborted requests remembered, so that embeddings that come after their abort are not kept."""
EARLY_KEPT = 64
"""Embeddings kept for requests not come yet (the oldest dropped past it: a request that never comes, as
one a restarted prefill never saw)."""


@dataclass
class _Encoded:
    embeds: torch.Tensor | None
    """[N, H] on prefill's device (None: `error`)."""
    grids: list[list[int]]
    """Each image's patch grid (t, h, w), as the message gave it."""
    error: str = ""


class ImageWaits:
    """Requests and embeddings that wait for each other; `ready` holds what a request's passes take."""

    def __init__(self, tokens: ImageTokens | None, device: torch.device, dtype: torch.dtype) -> None:
        self.tokens, self.device, self.dtype = tokens, device, dtype
        self.waiting: dict[str, Generate] = {}
        """Requests whose embeddings have not come."""
        self.encoded: OrderedDict[str, _Encoded] = OrderedDict()
        """Embeddings whose request has not come."""
        self.ready: dict[str, tuple[PromptImages, int]] = {}
        """Requests handed on, until their prefill starts: their prompt's images and rotary delta."""
        self._forgotten: OrderedDict[str, None] = OrderedDict()
        self._buffers: dict[bytes, torch.Tensor] = {}  # the encoder's buffer, mapped once a start of it

    def request(self, gen: Generate) -> tuple[list[Generate], list[tuple[str, Message]]]:
        """A request with images came: (requests now ready to queue, messages to send)."""
        if self.tokens is None:
            return [], [("router", Tokens(gen.rid, [], "error", error="this model takes no images"))]
        encoded = self.encoded.pop(gen.rid, None)
        if encoded is None:
            self.waiting[gen.rid] = gen
            return [], []
        return self._join(gen, encoded)

    def images(self, msg: ImagesEncoded) -> tuple[list[Generate], list[tuple[str, Message]]]:
        """An encoder's answer came: its rows copied (and given back, whatever happens here), its request
        handed on if it came (or failed, where the rows could not be read)."""
        gen = None if msg.rid in self._forgotten else self.waiting.pop(msg.rid, None)
        # Rows for a request not come yet wait in host memory (it may never come: a restarted prefill's).
        device = self.device if gen is not None else torch.device("cpu")
        encoded = _Encoded(None, [list(g) for g in msg.grids], msg.error)
        try:
            encoded.embeds = self._rows(msg, device)
        except Exception as exc:  # an unmappable buffer, no memory: this request fails, not the worker
            log.exception("reading the image rows of %s failed", msg.rid)
            encoded.error = f"reading the images' embeddings failed: {exc}"
        out: list[tuple[str, Message]] = [("encoder", ImagesTaken(msg.rid))] if msg.buffer is not None else []
        if msg.rid in self._forgotten:
            return [], out
        if gen is None:
            self.encoded[msg.rid] = encoded
            while len(self.encoded) > EARLY_KEPT:
                dropped, _ = self.encoded.popitem(last=False)
                log.warning("dropped the images of %s: its request did not come", dropped)
            return [], out
        ready, sent = self._join(gen, encoded)
        return ready, out + sent

    def _rows(self, msg: ImagesEncoded, device: torch.device) -> torch.Tensor | None:
        """A copy of the message's rows [N, H] on `device`, read when this returns (the encoder may write its
        lent rows again once it hears they are taken): they are in host memory, which a copy to a GPU has
        staged when `to` returns."""
        if msg.buffer is not None:
            rows = self._buffer(msg.buffer)[msg.start : msg.start + msg.rows]
        elif msg.data:  # an encoder on another machine: the rows came in the message
            raw = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8)
            rows = raw.view(ipc.dtype_from_name(msg.dtype)).view(msg.rows, -1)
        else:
            return None
        return rows.to(device, self.dtype, copy=True)

    def _buffer(self, buffer: SharedTensor) -> torch.Tensor:
        key = buffer.handle
        if key not in self._buffers:
            self._buffers = {key: ipc.import_tensor(buffer)}  # a restarted encoder's replaces the old
        return self._buffers[key]

    def _join(self, gen: Generate, encoded: _Encoded) -> tuple[list[Generate], list[tuple[str, Message]]]:
        if encoded.error:
            return [], [("router", Tokens(gen.rid, [], "error", error=encoded.error))]
        t = self.tokens
        assert t is not None  # a request waits only where the model takes images (`request`)
        try:
            embeds = encoded.embeds.to(self.device) if encoded.embeds is not None else torch.empty(0)
            grids = [(g_t, g_h, g_w) for g_t, g_h, g_w in encoded.grids]
            self.ready[gen.rid] = prompt_images(
                gen.prompt_ids, t.image_token_id, embeds, grids, t.merge, t.block
            )
        except ValueError as exc:
            return [], [("router", Tokens(gen.rid, [], "error", error=f"the prompt's images: {exc}"))]
        return [gen], []

    def take(self, rid: str) -> tuple[PromptImages, int] | None:
        """The prompt images of a request whose prefill starts (None: it has none)."""
        return self.ready.pop(rid, None)

    def held(self) -> list[Generate]:
        """Requests waiting for their embeddings."""
        return list(self.waiting.values())

    def forget(self, rid: str) -> None:
        """`rid` ended (aborted, failed): drop what it left here, and its embeddings if they come later."""
        self.waiting.pop(rid, None)
        self.encoded.pop(rid, None)
        self.ready.pop(rid, None)
        self._forgotten[rid] = None
        while len(self._forgotten) > FORGOTTEN:
            self._forgotten.popitem(last=False)

    def clear(self) -> None:
        self.waiting.clear()
        self.encoded.clear()
        self.ready.clear()
