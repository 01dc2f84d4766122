"""A supervised process stops with its supervisor (`--exit-with-parent`), even one killed with no chance to
stop its children (the workers and the router alike)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)
PARENT_PID_ENV = "SPILLWAY_PARENT_PID"
"""Set by a supervisor for the processes it starts (`services.children.Child`): its pid, read at once by
`stop_with_parent`, which would otherwise take `os.getppid()` only after the imports (a supervisor killed
meanwhile leaves the process under init, whose pid it would then watch for good)."""
PARENT_GONE_GRACE_S = 10.0
"""How long a process has to stop on its own once its parent is gone, before it is ended."""


def stop_with_parent(stop: Callable[[], None]) -> None:
    """Watch, from a daemon thread, the process that started this one (`--exit-with-parent`): once it is gone
    (a supervisor killed with no chance to stop its children: a SIGKILLed launcher, a lost Ray actor), call
    `stop`, and end the process PARENT_GONE_GRACE_S later if it is still running (loading a model, waiting
    for a peer that will not come)."""
    parent = int(os.environ.pop(PARENT_PID_ENV, 0) or os.getppid())  # (popped: its own children's is its)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        log.error("the process that started this one (pid %d) is gone: stopping", parent)
        stop()
        time.sleep(PARENT_GONE_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
