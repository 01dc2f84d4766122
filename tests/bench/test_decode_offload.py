"""bench.decode_offload's ablation variants: each names a kernel configuration field or an attribute that
exists, and a variant's value differs from the default's (a switch that flips nothing would time the
defaults twice)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from types import SimpleNamespace

import pytest

from bench.decode_offload import DECODE_SWITCHES, kernel_variants, other_switches, variant, variant_config
from common.kernels.config import KERNELS


def test_every_switch_flips_an_existing_attribute() -> None:
    provider = SimpleNamespace(combine_shared=True)
    configs, switches = kernel_variants(), other_switches(provider)
    assert sorted([*configs, *switches]) == sorted(DECODE_SWITCHES) and not set(configs) & set(switches)
    for name, changes in configs.items():
        for attr, value in changes.items():
            assert hasattr(KERNELS, attr), name
            assert getattr(KERNELS, attr) != value, name
    for name, (owner, attr, value) in switches.items():
        assert hasattr(owner, attr), name
        assert getattr(owner, attr) != value, name
    assert variant_config(KERNELS, "no-pdl+fp8-narrow") == replace(
        KERNELS, pdl=False, fp8_large_one_row=False
    )
    assert variant_config(KERNELS, "no-groups") == KERNELS


def test_a_variant_names_switches_joined_by_plus() -> None:
    assert variant("no-pdl+fp8-narrow") == "no-pdl+fp8-narrow"
    with pytest.raises(argparse.ArgumentTypeError, match="unknown switch 'no-such'"):
        variant("no-pdl+no-such")
