"""The tree stays ruff clean (lint and format), so style is checked wherever the tests run."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_clean(args: list[str]) -> None:
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed (it is part of the test extra)")
    paths = [p for p in ("common", "services", "tests", "bench") if (ROOT / p).is_dir()]
    result = subprocess.run([ruff, *args, *paths], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
