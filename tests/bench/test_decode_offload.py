"""bench.decode_offload's ablation switches: each names an attribute that exists, and a variant's value
differs from the default's (a switch that flips nothing would time the defaults twice)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from bench.decode_offload import DECODE_SWITCHES, decode_switches, variant


def test_every_switch_flips_an_existing_attribute() -> None:
    provider = SimpleNamespace(combine_shared=True, host_reads=False)
    switches = decode_switches(provider)
    assert list(switches) == list(DECODE_SWITCHES)
    for name, (owner, attr, value) in switches.items():
        assert hasattr(owner, attr), name
        assert getattr(owner, attr) != value, name


def test_a_variant_names_switches_joined_by_plus() -> None:
    assert variant("no-pdl+fp8-narrow") == "no-pdl+fp8-narrow"
    with pytest.raises(argparse.ArgumentTypeError, match="unknown switch 'no-such'"):
        variant("no-pdl+no-such")
