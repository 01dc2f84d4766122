"""Prefill's wait for the encoder (common/workers/image_waits.py): a request and its embeddings in either
order, rows copied out of the encoder's shared buffer and given back at once, errors and aborts."""

from __future__ import annotations

import msgspec
import torch

from common.ipc import tensors as ipc
from common.model.qwen4_exp.positions import ImageTokens
from common.protocol import Generate, ImagesEncoded, ImagesTaken, SamplingParams, Tokens, decode, encode
from common.workers.image_waits import EARLY_KEPT, ImageWaits

TOKENS = ImageTokens(image_token_id=7, merge=2, block=4)
PROMPT = [5, 9, *[7] * 6, 9, 5, 5, 5]  # one image of grid (1, 4, 6): 6 tokens


def _waits() -> ImageWaits:
    return ImageWaits(TOKENS, torch.device("cpu"), torch.float32)


def _gen(rid: str, prompt: list[int] = PROMPT) -> Generate:
    return Generate(rid, prompt, SamplingParams(), 0.0, images=1)


def _encoded(buffer: torch.Tensor, rid: str, start: int = 2, rows: int = 6) -> ImagesEncoded:
    msg = ImagesEncoded(rid, ipc.export_tensor(buffer), start, rows, [[1, 4, 6]])
    return decode(encode(msg))  # as it travels


def _buffer() -> torch.Tensor:
    buffer = ipc.shared_empty((16, 3), torch.bfloat16)
    buffer.copy_(torch.arange(48.0).view(16, 3))
    return buffer


def test_either_order_gives_the_rows_and_positions() -> None:
    buffer = _buffer()
    for first_request in (True, False):
        waits = _waits()
        if first_request:
            assert waits.request(_gen("a")) == ([], [])
            ready, out = waits.images(_encoded(buffer, "a"))
        else:
            _, out = waits.images(_encoded(buffer, "a"))
            ready, sent = waits.request(_gen("a"))
            assert sent == []
        assert [g.rid for g in ready] == ["a"]
        assert ("encoder", ImagesTaken("a")) in out
        images, delta = waits.take("a")
        assert delta == 3 - 6 and images.token_index.tolist() == list(range(2, 8))
        assert torch.equal(images.embeds, buffer[2:8].float())  # a copy, in the model's dtype
        assert images.embeds.data_ptr() != buffer[2:8].data_ptr()
        assert waits.take("a") is None


def test_errors_reach_the_router_and_rows_go_back() -> None:
    buffer, waits = _buffer(), _waits()
    waits.request(_gen("bad-prompt", PROMPT[:-2]))  # too little text after the image
    ready, out = waits.images(_encoded(buffer, "bad-prompt"))
    assert ready == [] and out[0] == ("encoder", ImagesTaken("bad-prompt"))
    assert isinstance(out[1][1], Tokens) and "followed by at least 3" in out[1][1].error

    waits.request(_gen("unreadable"))
    ready, out = waits.images(decode(encode(ImagesEncoded("unreadable", None, 0, 0, [], "no PNG"))))
    assert ready == [] and out == [("router", Tokens("unreadable", [], "error", error="no PNG"))]

    text_only = ImageWaits(None, torch.device("cpu"), torch.float32)
    _, out = text_only.request(_gen("c"))
    assert out[0][1].finish_reason == "error" and "no images" in out[0][1].error


def test_aborted_requests_leave_nothing() -> None:
    buffer, waits = _buffer(), _waits()
    waits.request(_gen("a"))
    waits.forget("a")
    assert waits.held() == []
    ready, out = waits.images(_encoded(buffer, "a"))  # after its abort: the rows still go back
    assert ready == [] and out == [("encoder", ImagesTaken("a"))] and not waits.encoded
    for i in range(EARLY_KEPT + 3):  # embeddings of requests that never come: the oldest dropped
        waits.images(_encoded(buffer, f"early-{i}"))
    assert len(waits.encoded) == EARLY_KEPT and "early-0" not in waits.encoded


def test_rows_that_cannot_be_read_fail_the_request_and_still_go_back() -> None:
    buffer, waits = _buffer(), _waits()
    gone = msgspec.structs.replace(ipc.export_tensor(buffer), handle=b"spillway-no-such-segment")
    waits.request(_gen("a"))
    ready, out = waits.images(ImagesEncoded("a", gone, 2, 6, [[1, 4, 6]]))
    assert ready == [] and out[0] == ("encoder", ImagesTaken("a"))
    assert out[1][1].finish_reason == "error" and "embeddings failed" in out[1][1].error
    assert waits.held() == []
