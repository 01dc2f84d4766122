"""A supervised process stops with its supervisor (`--exit-with-parent`), even one killed with no chance to
stop its children (the workers and the router alike)."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)
PARENT_PID_ENV = "SPILLWAY_PARENT_PID"
"""Set by a supervisor for the processes it starts (`services.children.Child`): its pid, read at once by
`stop_with_parent`, which would otherwise take `os.getppid()` only after the imports (a supervisor killed
meanwhile leaves the process under init, whose pid it would then watch for good)."""
RUN_DIR_ENV = "SPILLWAY_RUN_DIR"
"""Set by the local launcher for its services: its run directory, which they remove once it is gone."""
RESTARTS_ENV = "SPILLWAY_RESTARTS"
"""Set by a supervisor for the router it (re)starts: a JSON object, each service's restarts so far by name
(the router's `/health` goes on from them)."""
OWNER = "launcher.pid"
"""The file in a run directory that names the launcher it belongs to."""
PARENT_GONE_GRACE_S = 10.0
"""How long a process has to stop on its own once its parent is gone, before it is ended."""


def stop_with_parent(stop: Callable[[], None]) -> None:
    """Watch, from a daemon thread, the process that started this one (`--exit-with-parent`): once it is gone
    (a supervisor killed with no chance to stop its children: a SIGKILLed launcher, a lost Ray actor), call
    `stop`, and end the process PARENT_GONE_GRACE_S later if it is still running (loading a model, waiting
    for a peer that will not come). The run directory of `RUN_DIR_ENV`, where it names this parent as its
    owner, is removed first (a SIGKILLed launcher cannot: `remove_run_dir`)."""
    parent = int(os.environ.pop(PARENT_PID_ENV, 0) or os.getppid())  # (popped: its own children's is its)
    run_dir = os.environ.pop(RUN_DIR_ENV, "")

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        log.error("the process that started this one (pid %d) is gone: stopping", parent)
        if run_dir:
            remove_run_dir(run_dir, parent)
        stop()
        time.sleep(PARENT_GONE_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def remove_run_dir(run_dir: str, owner: int) -> None:
    """Remove the run directory `run_dir` if its OWNER file names the process `owner` (gone: the services
    it started end with it); another's, or one already removed, is left as it is."""
    try:
        if int((Path(run_dir) / OWNER).read_text()) != owner:
            return
    except (OSError, ValueError):
        return
    shutil.rmtree(run_dir, ignore_errors=True)
