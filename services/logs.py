"""One log format for every Spillway process: `TIME SERVICE LEVEL message` lines, or one JSON object a line
(`--log-format json`: time, service, level, logger, message and a record's `fields`), on stderr.

`spillway serve --log-level/--log-format` put the choice in the environment its children inherit
(LOG_LEVEL_ENV, LOG_FORMAT_ENV); a process's own arguments win. Uvicorn's loggers go through the same handler.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from datetime import UTC, datetime

LOG_LEVEL_ENV, LOG_FORMAT_ENV = "SPILLWAY_LOG_LEVEL", "SPILLWAY_LOG_FORMAT"
LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
FIELDS = "fields"
"""A record's extra key whose dict the JSON form adds as keys (the access log's method, status, ...)."""


class _Text(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__(f"%(asctime)s {service} %(levelname)s %(message)s")


class _Json(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "service": self.service,
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **getattr(record, FIELDS, {}),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def setup_logging(service: str, level: str | None = None, fmt: str | None = None) -> None:
    """Log every record of this process as `service` at `level` (else LOG_LEVEL_ENV's, else info) in `fmt`
    ("text" | "json"; else LOG_FORMAT_ENV's, else text); replaces any handlers set before."""
    level = (level or os.environ.get(LOG_LEVEL_ENV) or "info").lower()
    fmt = (fmt or os.environ.get(LOG_FORMAT_ENV) or "text").lower()
    if level not in LEVELS or fmt not in FORMATS:
        raise ValueError(f"log level {level!r} / format {fmt!r}: levels {LEVELS}, formats {FORMATS}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Json(service) if fmt == "json" else _Text(service))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):  # through the root's handler
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True


def add_log_args(parser: argparse.ArgumentParser) -> None:
    """`--log-level` and `--log-format` (default: the environment's, else info and text)."""
    parser.add_argument("--log-level", default=None, choices=LEVELS, help="default info")
    parser.add_argument("--log-format", default=None, choices=FORMATS, help="default text")


def log_choice_env(level: str | None, fmt: str | None) -> dict[str, str]:
    """The environment entries that hand a launcher's `--log-level` / `--log-format` to its children."""
    env = {LOG_LEVEL_ENV: level} if level else {}
    return {**env, LOG_FORMAT_ENV: fmt} if fmt else env
