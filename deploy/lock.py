"""Writes deploy/requirements.lock: every package the image installs beside torch, pinned, as pip resolves
`pyproject.toml`'s dependencies for the image's Python (run it with that Python, from the repository root):

    python deploy/lock.py

torch is left out: the Dockerfile installs it first, from the index of the build it wants (CPU or CUDA).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

LOCK = Path(__file__).with_name("requirements.lock")
LEFT_OUT = {"spillway", "torch"}


def resolve() -> list[tuple[str, str]]:
    """(name, version) of each package pip would install for this project and torch, torch's own left out."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        argv = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
        subprocess.run([*argv, "--report", str(report), "torch==2.13.0", "."], check=True)
        installs = json.loads(report.read_text())["install"]
    pins = {(i["metadata"]["name"].lower(), i["metadata"]["version"]) for i in installs}
    return sorted((n, v) for n, v in pins if n not in LEFT_OUT and not n.startswith("nvidia-"))


def main() -> None:
    lines = [f"{name}=={version}" for name, version in resolve()]
    header = "# Written by deploy/lock.py (Python 3.11): the image's packages beside torch, pinned.\n"
    LOCK.write_text(header + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
