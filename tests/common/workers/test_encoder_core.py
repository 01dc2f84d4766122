"""EncoderCore stepped in-process on a tiny qwen4_exp model with its vision tower: the rows it lends (through
the wire encoding and an imported shared-memory buffer) equal ImageEncoder's embeddings; requests wait in
arrival order for rows and start when rows are taken or aborted; bad requests get an error, not rows."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from common.ipc import tensors as ipc
from common.model.synthetic.checkpoint import make_model
from common.protocol import Encode, ImagesEncoded, decode, encode
from common.vision.encoder import ImageEncoder
from common.vision.images import decode_image
from common.workers.encoder import EncoderCore, RowRanges

Image = pytest.importorskip("PIL.Image")

WIDE, SQUARE = (50, 90), (64, 64)
"""Image sizes (h, w) the tiny model's tower makes 6 and 4 tokens of (grids (1, 4, 6) and (1, 4, 4))."""


def png(size: tuple[int, int], seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def encoder(tmp_path_factory) -> ImageEncoder:
    model = make_model(tmp_path_factory.mktemp("q4") / "q4", "tiny", "qwen4_exp", {"torch_dtype": "float32"})
    return ImageEncoder(model)


def served(core: EncoderCore) -> list[tuple[str, ImagesEncoded]]:
    """One step's messages, through the wire encoding."""
    return [(dest, decode(encode(msg))) for dest, msg in core.step()]


def test_the_lent_rows_are_the_encoders_embeddings(encoder: ImageEncoder) -> None:
    core = EncoderCore(encoder, capacity_rows=64)
    images = [png(WIDE, 1), png(SQUARE, 2)]
    core.submit(Encode("a", images, "prefill-1"))
    core.submit(Encode("b", [png(SQUARE, 3)], "prefill"))
    ((dest, msg),) = served(core)
    want = encoder.encode([decode_image(raw) for raw in images])
    assert dest == "prefill-1" and msg.error == ""
    assert (msg.rid, msg.start, msg.rows) == ("a", 0, 10)
    assert msg.grids == [[1, 4, 6], [1, 4, 4]] == [list(e.grid) for e in want]
    rows = ipc.import_tensor(msg.buffer)  # [capacity, H], mapped as prefill maps it
    assert rows.shape == (64, 64) and rows.dtype == torch.float32
    torch.testing.assert_close(rows[0:10], torch.cat([e.embeddings for e in want]), rtol=0, atol=0)
    ((dest, second),) = served(core)
    assert (dest, second.start, second.rows) == ("prefill", 10, 4) and second.buffer == msg.buffer
    assert (core.running, core.waiting, core.busy) == (2, 0, False)


def test_the_buffer_dtype_casts_the_embeddings(encoder: ImageEncoder) -> None:
    core = EncoderCore(encoder, capacity_rows=16, dtype=torch.bfloat16)
    core.submit(Encode("a", [png(SQUARE)], "prefill"))
    ((_, msg),) = served(core)
    (want,) = encoder.encode([decode_image(png(SQUARE))])
    assert msg.buffer.dtype == "bfloat16"
    assert torch.equal(ipc.import_tensor(msg.buffer)[:4], want.embeddings.to(torch.bfloat16))


def test_requests_wait_in_order_for_rows_and_start_when_rows_come_back(encoder: ImageEncoder) -> None:
    core = EncoderCore(encoder, capacity_rows=14)
    core.submit(Encode("a", [png(WIDE), png(SQUARE)], "prefill"))  # 10 rows
    core.submit(Encode("b", [png(WIDE)], "prefill"))  # 6: waits
    core.submit(Encode("c", [png(SQUARE)], "prefill"))  # 4 would fit, but it is behind b
    assert [m.rid for _, m in served(core)] == ["a"]
    assert served(core) == [] and served(core) == []
    assert (core.waiting, core.busy) == (2, False), "nothing to do until rows come back"
    core.taken("a")
    assert core.busy
    assert [(m.rid, m.start) for _, m in served(core)] == [("b", 0)]
    assert [(m.rid, m.start) for _, m in served(core)] == [("c", 6)]
    core.submit(Encode("d", [png(WIDE), png(SQUARE)], "prefill"))  # 10 rows; 4 are free
    assert served(core) == [] and core.waiting == 1
    core.abort("d")  # dropped from the queue
    assert (core.waiting, served(core)) == (0, [])
    core.abort("b")
    core.taken("c")
    assert core.ranges.free == [(0, 14)] and core.running == 0, "freed ranges coalesce"
    core.taken("c")  # again (or after an abort): nothing to free


def test_bad_requests_get_an_error_and_no_rows(encoder: ImageEncoder) -> None:
    core = EncoderCore(encoder, capacity_rows=8)
    core.submit(Encode("junk", [png(SQUARE), b"not an image"], "prefill"))
    core.submit(Encode("big", [png(WIDE), png(SQUARE)], "prefill"))  # 10 rows of 8
    core.submit(Encode("fine", [png(SQUARE)], "prefill"))
    (junk,) = [m for _, m in served(core)]
    assert (junk.buffer, junk.start, junk.rows, junk.grids) == (None, 0, 0, [])
    assert "image 2 of 2" in junk.error and "cannot be read" in junk.error
    (big,) = [m for _, m in served(core)]
    assert big.buffer is None and "need 10 embedding rows" in big.error and "8 rows" in big.error
    (fine,) = [m for _, m in served(core)]
    assert (fine.rid, fine.start, fine.rows, fine.error) == ("fine", 0, 4, "")


def test_a_failed_tower_pass_gives_its_rows_back(encoder: ImageEncoder, monkeypatch) -> None:
    core = EncoderCore(encoder, capacity_rows=8)

    def fail(images):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(encoder, "encode", fail)
    core.submit(Encode("a", [png(SQUARE)], "prefill"))
    (msg,) = [m for _, m in served(core)]
    assert msg.buffer is None and msg.error == "encoding the images failed: out of memory"
    assert core.ranges.free == [(0, 8)] and core.running == 0


def test_a_second_encode_of_a_rid_is_ignored_and_no_images_take_no_rows(encoder: ImageEncoder) -> None:
    core = EncoderCore(encoder, capacity_rows=8)
    core.submit(Encode("a", [png(SQUARE)], "prefill"))
    core.submit(Encode("a", [png(SQUARE)], "prefill"))
    assert core.waiting == 1
    served(core)
    core.submit(Encode("a", [png(SQUARE)], "prefill"))  # lent: still ignored
    core.submit(Encode("none", [], "prefill"))
    assert core.waiting == 1
    (msg,) = [m for _, m in served(core)]
    assert (msg.rid, msg.rows, msg.grids, msg.error) == ("none", 0, [], "") and msg.buffer is not None
    assert core.ranges.free == [(4, 4)]


def test_row_ranges_are_first_fit_and_coalesce() -> None:
    ranges = RowRanges(10)
    assert [ranges.allocate(n) for n in (3, 3, 3)] == [0, 3, 6]
    assert ranges.allocate(2) is None and ranges.fits(1) and not ranges.fits(2)
    ranges.release(3, 3)
    assert ranges.allocate(4) is None, "free rows 3..6 and 9..10 are not contiguous"
    assert ranges.allocate(2) == 3
    ranges.release(0, 3)
    ranges.release(6, 3)
    assert ranges.free == [(0, 3), (5, 5)]
    ranges.release(3, 2)
    assert ranges.free == [(0, 10)] and ranges.free_rows == 10
    with pytest.raises(ValueError, match="free already"):
        ranges.release(2, 3)
    with pytest.raises(ValueError, match="outside"):
        ranges.release(8, 3)


def test_the_stats_count_images_rows_passes_and_refusals_by_reason(
    encoder: ImageEncoder, monkeypatch
) -> None:
    core = EncoderCore(encoder, capacity_rows=8)
    core.submit(Encode("a", [png(SQUARE, 1), png(SQUARE, 2)], "prefill"))  # 8 rows: all of them
    core.submit(Encode("junk", [b"not an image"], "prefill"))
    core.submit(Encode("big", [png(WIDE), png(SQUARE)], "prefill"))  # 10 rows of 8
    core.submit(Encode("none", [], "prefill"))  # written (no rows), but no tower pass to time
    assert [m.error == "" for _ in range(4) for _, m in served(core)] == [True, False, False, True]
    stats = core.stats
    assert (stats.images, stats.rows, stats.passes, len(stats.pass_seconds)) == (2, 8, 1, 1)
    assert 0 < stats.pass_seconds[0] < 60
    assert stats.refused == {"decode": 1, "too_large": 1, "failed": 0}
    assert (core.rows_lent, core.running) == (8, 2)
    core.taken("a")
    assert core.rows_lent == 0

    def fail(images):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(encoder, "encode", fail)
    core.submit(Encode("b", [png(SQUARE)], "prefill"))
    served(core)
    assert stats.refused["failed"] == 1 and (stats.images, stats.rows, stats.passes) == (2, 8, 1)
