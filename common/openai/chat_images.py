"""A chat's `image_url` parts into prompt tokens, in the router (the encoder turns the images themselves into
embeddings).

An image part becomes the model's placeholder text at its place in the message (vision start, one image
token, vision end: what Qwen-VL chat templates render for it), so the chat template sees a string, as for text
parts. After tokenizing, each image's one image token is repeated to the count of tokens its embeddings take
(t · h · w / merge² of its patch grid, which depends on the image's size only), as transformers' Qwen-VL
processors expand it. The images travel on as their files' bytes. Each image's pixels, and all of a
request's, are held to a budget read from the files' headers before any is decoded.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from common.text.tokenizer import Tokenizer
from common.vision.images import (
    ImageProcessing,
    check_pixels,
    data_url_bytes,
    decode_image,
    image_grid,
    image_size,
)


@dataclass(frozen=True)
class ChatImage:
    """One image of a request: its file, and the prompt tokens it takes."""

    raw: bytes
    tokens: int
    pixels: int = 0
    """Width x height, as the file's header gives them."""


@dataclass(frozen=True)
class ImagePrompting:
    """How a model's prompts carry images (a checkpoint with a vision tower)."""

    processing: ImageProcessing
    placeholder: str
    """The text an image part becomes: vision start, the image token, vision end."""
    image_token_id: int
    max_image_pixels: int | None = None
    """Most pixels of one image (None: any)."""
    max_request_pixels: int | None = None
    """Most pixels of a request's images together (None: any)."""

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        tokenizer: Tokenizer,
        max_image_pixels: int | None = None,
        max_request_pixels: int | None = None,
    ) -> ImagePrompting | None:
        """None for a model without a vision tower; ValueError for one whose tokenizer lacks its tokens.
        The pixel budgets as the fields of that name."""
        config = json.loads((Path(model_dir) / "config.json").read_text())
        if not config.get("vision_config"):
            return None
        keys = ("vision_start_token_id", "image_token_id", "vision_end_token_id")
        ids = [config.get(k) for k in keys]
        texts = [tokenizer.id_to_token(i) if isinstance(i, int) else None for i in ids]
        found = [t for t in texts if t is not None]
        if len(found) < len(texts):
            missing = ", ".join(k for k, t in zip(keys, texts, strict=True) if t is None)
            raise ValueError(f"{model_dir}: the tokenizer has no token for {missing} of config.json")
        processing = ImageProcessing.from_model_dir(model_dir)
        return cls(processing, "".join(found), ids[1], max_image_pixels, max_request_pixels)

    def read(self, url: str, earlier: Sequence[ChatImage] = ()) -> ChatImage:
        """An `image_url` part's `data:` URL → the image and its token count; ValueError saying what is
        wrong with it (over a pixel budget, with the request's `earlier` images, among it)."""
        return self.read_file(data_url_bytes(url), earlier)

    def read_file(self, raw: bytes, earlier: Sequence[ChatImage] = ()) -> ChatImage:
        """An image file's bytes → the image and its token count; ValueError where it cannot be read, or
        it, or it with the request's `earlier` images, is over the pixel budget (checked before decoding)."""
        width, height = size = image_size(raw)
        check_pixels(size, self.max_image_pixels)
        check_pixels(size, self.max_request_pixels, sum(image.pixels for image in earlier))
        grid = image_grid(decode_image(raw, self.max_image_pixels), self.processing)
        return ChatImage(raw, self.processing.tokens(grid), width * height)

    def expand(self, ids: list[int], images: list[ChatImage]) -> list[int]:
        """The prompt with each image's one image token repeated to its count; ValueError where the prompt
        does not hold one image token an image (the text named the token itself)."""
        at = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(at) != len(images):
            raise ValueError(
                f"the prompt holds {len(at)} image tokens for {len(images)} images (is the image token in "
                "the text?)"
            )
        out, last = [], 0
        for i, image in zip(at, images, strict=True):
            out += ids[last:i] + [self.image_token_id] * image.tokens
            last = i + 1
        return out + ids[last:]
