"""EncoderMetricsExporter: an EncoderCore's stats reach Prometheus once each, however often it is called."""

from __future__ import annotations

import io

import numpy as np
import pytest

from common import metrics
from common.model.synthetic.checkpoint import make_model
from common.protocol import Encode
from common.workers.encoder import RECENT_PASSES, EncoderCore
from common.workers.encoder_metrics import EncoderMetricsExporter

Image = pytest.importorskip("PIL.Image")


def png(h: int, w: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.zeros((h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def core(tmp_path_factory) -> EncoderCore:
    model = make_model(tmp_path_factory.mktemp("q4") / "q4", "tiny", "qwen4_exp", {"torch_dtype": "float32"})
    return EncoderCore.from_model_dir(model, capacity_rows=12)


def test_the_exporter_moves_each_count_once_and_the_lent_rows_as_they_are(core: EncoderCore) -> None:
    registry = metrics.new_registry()
    exporter = EncoderMetricsExporter(core, metrics.EncoderMetrics.create(registry))

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(f"spillway:{name}", labels)

    assert (
        value("encoder_rows_capacity") == 12 and value("image_requests_refused_total", reason="failed") == 0
    )
    core.submit(Encode("a", [png(64, 64), png(50, 90)], "prefill"))  # 4 + 6 rows
    core.submit(Encode("junk", [b"no"], "prefill"))
    core.step()
    core.step()
    exporter.update()
    exporter.update()  # nothing new: nothing counted twice
    assert (value("images_encoded_total"), value("image_tokens_total")) == (2, 10)
    assert value("image_encode_seconds_count") == 1 and value("image_encode_seconds_sum") > 0
    assert value("image_requests_refused_total", reason="decode") == 1
    assert value("encoder_rows_lent") == 10
    core.taken("a")
    exporter.update()
    assert value("encoder_rows_lent") == 0 and value("image_encode_seconds_count") == 1


def test_the_new_passes_are_the_newest_the_core_still_keeps(core: EncoderCore) -> None:
    core.submit(Encode("b", [png(64, 64)], "prefill"))
    core.step()
    core.taken("b")
    exporter = EncoderMetricsExporter(core, metrics.EncoderMetrics.create(metrics.new_registry()))
    kept = list(core.stats.pass_seconds)
    assert exporter._new_passes(0) == [] and exporter._new_passes(1) == kept[-1:]
    assert exporter._new_passes(RECENT_PASSES + 5) == kept, "passes older than the core keeps go untimed"
