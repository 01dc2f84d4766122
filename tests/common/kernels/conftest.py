"""Without triton installed the kernel tests are skipped (tests/conftest.py puts Triton in its interpreter
on a machine without CUDA)."""

from __future__ import annotations

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("triton") else ["test_*.py"]
