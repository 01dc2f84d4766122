"""bench.decode_offload's ablation switches: each names an attribute that exists, and a variant's value
differs from the default's (a switch that flips nothing would time the defaults twice)."""

from __future__ import annotations

from types import SimpleNamespace

from bench.decode_offload import DECODE_SWITCHES, decode_switches


def test_every_switch_flips_an_existing_attribute() -> None:
    provider = SimpleNamespace(combine_shared=True, host_reads=False)
    switches = decode_switches(provider)
    assert list(switches) == list(DECODE_SWITCHES)
    for name, (owner, attr, value) in switches.items():
        assert hasattr(owner, attr), name
        assert getattr(owner, attr) != value, name
