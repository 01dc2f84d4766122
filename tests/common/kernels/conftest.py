"""Triton kernels on a machine without CUDA run in Triton's interpreter (same semantics, numpy underneath):
the switch is read when triton is first imported, so it is set here, before any test module imports a kernel.
Without triton installed the kernel tests are skipped."""

from __future__ import annotations

import importlib.util
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

collect_ignore_glob = [] if importlib.util.find_spec("triton") else ["test_*.py"]
