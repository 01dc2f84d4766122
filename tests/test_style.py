"""The tree stays ruff clean (lint and format), type-checks (mypy) and keeps its import contracts
(pyproject.toml's [tool.importlinter]), so style, types and layering are checked wherever the tests run."""

from __future__ import annotations

import os
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


def test_import_contracts_kept() -> None:
    """lint-imports: the layers of common/ and services/, kernels as leaves, config.py at the bottom, no
    import cycle within a package."""
    lint_imports = shutil.which("lint-imports")
    if lint_imports is None:
        pytest.fail("import-linter is not installed (it is part of the test extra)")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run([lint_imports, "--no-cache"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stdout + result.stderr


def test_types_checked() -> None:
    """mypy (pyproject.toml's [tool.mypy]: common/ and services/) reports no error."""
    mypy = shutil.which("mypy")
    if mypy is None:
        pytest.fail("mypy is not installed (it is part of the test extra)")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run([mypy], cwd=ROOT, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
