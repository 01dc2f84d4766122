"""The int4 decode kernels compiled for sm_90 without a GPU (bench.sass_census): the words form converts no
code from int to float and converts layouts once, where the byte form does both; every kernel loops."""

from __future__ import annotations

from common.kernels.moe_int4 import DECODE_CONFIGS, RESIDENT_CONFIGS


def test_census_tells_the_words_form_from_the_byte_form() -> None:
    from bench.sass_census import int4_decode_census

    byte_form, words = int4_decode_census(DECODE_CONFIGS[1]), int4_decode_census(RESIDENT_CONFIGS[1])
    for name in ("gate_up", "down"):
        (b, b_us), (w, w_us) = byte_form[name], words[name]
        conversions = [c.opcodes["I2F"] + c.opcodes["I2FP"] for c in (b, w)]
        assert conversions[1] < 8 < 16 <= conversions[0], (name, conversions)  # words: index math only
        assert w.conversions == 1 < b.conversions, name
        assert b.loop > 0 and b.total > b.loop and b_us > 0 and w_us > 0
    assert words["down"][1] < byte_form["down"][1]  # one group a step: no idle lanes
