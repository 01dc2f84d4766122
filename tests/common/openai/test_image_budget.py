"""The image budget: pixels per image and per request, read from the files' headers before anything is
decoded; a request past it is a 400 naming the image, answered at once however large the image claims to
be (a PNG of 13,000 x 13,000 pixels in a few hundred KB)."""

from __future__ import annotations

import base64
import io
import json
import struct
import time
import zlib
from pathlib import Path

import pytest

from common.openai import api
from common.openai import prompts as openai_prompts
from common.openai.api import ApiError
from common.openai.chat_images import ImagePrompting
from common.text.tokenizer import Tokenizer
from common.vision.images import decode_image, image_size

Image = pytest.importorskip("PIL.Image")


def huge_png(width: int, height: int) -> bytes:
    """A valid black 1-bit PNG of width x height, made without holding its pixels (zlib packs the rows of
    zeros a thousandfold)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = bytes(1 + (width + 7) // 8)  # filter byte, then the bits
    packer = zlib.compressobj(9)
    idat = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from common.model.synthetic.checkpoint import make_model

    return make_model(tmp_path_factory.mktemp("q4") / "tiny-q4v", "tiny", "qwen4_exp")


def chat_ids(model: Path, urls: list[str], **budget: int) -> list[int]:
    """A chat of `urls`' images as the router reads it, with the pixel budget `budget`."""
    tok = Tokenizer.from_dir(model)
    prompting = ImagePrompting.from_model_dir(model, tok, **budget)
    images = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    parts = [{"type": "text", "text": "look"}, *images]
    body = {"model": "m", "messages": [{"role": "user", "content": parts}]}
    request = api.parse_chat_request(json.dumps(body).encode())
    return openai_prompts.chat_prompt_ids(request, tok, prompting).ids


def test_a_huge_png_is_refused_from_its_header_at_once(model: Path) -> None:
    bomb = huge_png(13_000, 13_000)
    assert len(bomb) < 1_000_000 and image_size(bomb) == (13_000, 13_000)
    started = time.monotonic()
    with pytest.raises(ApiError) as info:
        chat_ids(model, [data_url(bomb)] * 4, max_image_pixels=2**25, max_request_pixels=2**27)
    assert time.monotonic() - started < 1.0  # decoded, each would take far longer (and its pixels' memory)
    error = info.value
    assert error.status == 400 and error.param == "messages[0].content[1].image_url.url"
    assert "33,554,432 pixels" in error.message and "13000 x 13000" in error.message
    with pytest.raises(ValueError, match="at most 100 pixels"):
        decode_image(bomb, max_pixels=100)


def test_a_requests_images_together_are_held_to_its_budget(model: Path) -> None:
    small = data_url(png(40, 30))  # 1,200 pixels
    assert chat_ids(model, [small, small], max_image_pixels=1200, max_request_pixels=2400)
    with pytest.raises(ApiError) as info:
        chat_ids(model, [small, small, small], max_image_pixels=1200, max_request_pixels=2400)
    assert info.value.param == "messages[0].content[3].image_url.url"
    assert "images together" in info.value.message and "3,600" in info.value.message
    with pytest.raises(ApiError, match="an image may have at most 1,000 pixels"):
        chat_ids(model, [small], max_image_pixels=1000)
