"""The router's HTTP middleware: each request's id (`X-Request-Id`), and one access line a request when its
response has been sent (a stream: its last byte): method, path, status, latency, the tokens in and out, and
the request's id."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from starlette.types import Receive, Scope, Send

from services.logs import FIELDS

log = logging.getLogger("access")
REQUEST_ID = "spillway.request_id"
"""The ASGI scope key of a request's id: the `X-Request-Id` of every response, errors included, and the id
its generation has at the workers."""
QUIET = ("/health", "/metrics")
"""Paths polled by supervisors and scrapers: their access lines are debug."""
TOKENS = "spillway.tokens"
"""The ASGI scope key of a callable giving a request's (prompt, completion) tokens so far (its choices')."""


class RequestIds:
    """ASGI middleware: gives each HTTP request an id and every response the `X-Request-Id` header."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = scope[REQUEST_ID] = uuid.uuid4().hex

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())],
                }
            await send(message)

        await self.app(scope, receive, send_with_id)


class AccessLog:
    """ASGI middleware (inside `RequestIds`): logs each HTTP request's access line as its response ends,
    or as the app fails it (status 500) or the client leaves (status 499, nginx's)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.monotonic(), [499]

        async def send_watched(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_watched)
        except BaseException:
            status[0] = 500 if status[0] == 499 else status[0]
            raise
        finally:
            _line(scope, status[0], time.monotonic() - start)


def _line(scope: Scope, status: int, seconds: float) -> None:
    tokens = scope.get(TOKENS)
    prompt, completion = tokens() if tokens is not None else (0, 0)
    fields = {
        "method": scope["method"], "path": scope["path"], "status": status,
        "latency_ms": round(seconds * 1000, 1), "prompt_tokens": prompt, "completion_tokens": completion,
        "request_id": scope.get(REQUEST_ID, ""),
    }  # fmt: skip
    level = logging.DEBUG if scope["path"] in QUIET else logging.INFO
    log.log(level, "%s %s %d %.1f ms tokens %d/%d id %s", *fields.values(), extra={FIELDS: fields})
