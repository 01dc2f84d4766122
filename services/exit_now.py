"""End a service process at once once its work is done, skipping the interpreter's teardown."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Run the atexit handlers (shared memory this process made is unlinked, its fd server closed), flush the
    logs and standard streams, then `os._exit(code)`: the rest of the interpreter's teardown (torch, the
    model's memory) takes seconds and is not needed. SIGTERM thus ends a service in well under a second."""
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe: nothing can reach it
            stream.flush()
    os._exit(code)
