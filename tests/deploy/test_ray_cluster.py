"""deploy/ray/cluster.yaml: a valid Ray cluster config (Ray's own schema and defaults), and the serve command
it documents parses with spillway's command line."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from services.cli import build_parser

pytest.importorskip("ray")
CLUSTER = Path(__file__).resolve().parents[2] / "deploy" / "ray" / "cluster.yaml"


def test_the_cluster_config_is_valid_for_ray() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load(CLUSTER.read_text())
    validate_config(config)
    validate_config(prepare_config(config))  # with Ray's defaults filled in
    head = " ".join(config["head_start_ray_commands"])
    assert "--num-gpus=0" in head, "the head runs the router: no pair is placed there"
    assert any("spillway[ray" in c for c in config["setup_commands"])


def test_the_documented_serve_command_parses() -> None:
    text = CLUSTER.read_text()
    match = re.search(r"ray exec deploy/ray/cluster.yaml '(.*?)'", text.replace("\\\n#", ""), re.S)
    assert match, "the serve command is documented"
    argv = shlex.split(match.group(1))
    assert argv[0] == "spillway"
    args = build_parser().parse_args(argv[1:])
    assert (args.command, args.ray, args.pairs) == ("serve", "auto", 2)
