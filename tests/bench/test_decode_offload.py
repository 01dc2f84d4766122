"""bench.decode_offload's ablation variants: each names a kernel configuration field, and a variant's value
differs from the default's (a switch that flips nothing would time the defaults twice)."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from bench.decode_offload import DECODE_SWITCHES, kernel_variants, variant, variant_config
from common.kernels.config import KERNELS


def test_every_switch_flips_an_existing_field() -> None:
    configs = kernel_variants()
    assert sorted(configs) == sorted(DECODE_SWITCHES)
    for name, changes in configs.items():
        for attr, value in changes.items():
            assert hasattr(KERNELS, attr), name
            assert getattr(KERNELS, attr) != value, name
    assert variant_config(KERNELS, "no-pdl+fp8-narrow") == replace(
        KERNELS, pdl=False, fp8_large_one_row=False
    )
    assert variant_config(KERNELS, "no-groups") == replace(KERNELS, split_lanes=0)


def test_a_variant_names_switches_joined_by_plus() -> None:
    assert variant("no-pdl+fp8-narrow") == "no-pdl+fp8-narrow"
    with pytest.raises(argparse.ArgumentTypeError, match="unknown switch 'no-such'"):
        variant("no-pdl+no-such")
