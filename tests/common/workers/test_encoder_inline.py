"""The encoder for prefill workers on other machines (`--inline`): the embeddings travel in `ImagesEncoded`
itself (raw bytes in the buffer's dtype), no rows are lent, and prefill's ImageWaits takes them as it takes
lent rows, with nothing to give back."""

from __future__ import annotations

import torch

from common.model.qwen4_exp.positions import ImageTokens
from common.model.synthetic.checkpoint import make_model
from common.protocol import Encode, Generate, SamplingParams
from common.vision.encoder import ImageEncoder
from common.vision.images import decode_image
from common.workers.encoder import EncoderCore
from common.workers.image_waits import ImageWaits
from tests.common.workers.test_encoder_core import SQUARE, WIDE, png, served


def test_inline_rows_are_the_embeddings(tmp_path) -> None:
    model = make_model(tmp_path / "q4", "tiny", "qwen4_exp", {"torch_dtype": "float32"})
    encoder = ImageEncoder(model)
    core = EncoderCore(encoder, capacity_rows=12, dtype=torch.bfloat16, inline=True)
    assert core.buffer is None and core.shared is None
    images = [png(WIDE, 1), png(SQUARE, 2)]
    core.submit(Encode("a", images, "prefill"))
    core.submit(Encode("too-big", [png(WIDE, 3), png(WIDE, 4), png(WIDE, 5)], "prefill"))
    ((dest, msg),) = served(core)
    assert dest == "prefill" and msg.buffer is None and (msg.rows, msg.dtype) == (10, "bfloat16")
    assert core.running == 0  # nothing lent
    ((_, refused),) = served(core)
    assert refused.rid == "too-big" and "more than" in refused.error  # --rows still bounds a request

    want = torch.cat([e.embeddings for e in encoder.encode([decode_image(raw) for raw in images])])
    waits = ImageWaits(ImageTokens(1022, 2, 4), torch.device("cpu"), torch.float32)
    prompt = [5, *[1022] * 6, 9, *[1022] * 4, 9, 5, 5, 5]
    waits.request(Generate("a", prompt, SamplingParams(), 0.0, images=2))
    ready, out = waits.images(msg)
    assert [g.rid for g in ready] == ["a"] and out == []  # no rows to give back
    images_of_a, _ = waits.take("a")
    torch.testing.assert_close(images_of_a.embeds, want.to(torch.bfloat16).float(), rtol=0, atol=0)
