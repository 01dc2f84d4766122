"""The Compose Specification's JSON schema, as the Compose reference implementation ships it (docker-compose
1.29.2's `compose/config/compose_spec.json`, its wheel fetched once from the package index into the cache),
and the merge `docker compose -f A -f B` applies to the files checked against it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

SCHEMA_IN_WHEEL = "compose/config/compose_spec.json"


def compose_schema(cache: Path | None = None) -> dict:
    """The schema (the wheel downloaded under `cache`, default $SPILLWAY_CACHE or ~/.cache/spillway)."""
    cache = cache or Path(os.environ.get("SPILLWAY_CACHE", Path.home() / ".cache" / "spillway"))
    where = cache / "compose-schema"
    wheels = list(where.glob("docker_compose-1.29.2-*.whl"))
    if not wheels:
        argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(where)]
        subprocess.run([*argv, "docker-compose==1.29.2"], check=True)
        wheels = list(where.glob("docker_compose-1.29.2-*.whl"))
    with zipfile.ZipFile(wheels[0]) as wheel:
        return json.loads(wheel.read(SCHEMA_IN_WHEEL))


def merged(base: dict, override: dict) -> dict:
    """`override` on top of `base` as Compose merges files: mappings key by key, anything else replaced."""
    out = dict(base)
    for key, value in override.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merged(out[key], value) if both else value
    return out
