"""The router's HTTP/1.1 protocol: uvicorn's h11 one, but a request it cannot parse is answered in full.

uvicorn answers a request whose head is over h11's limit (`h11_max_incomplete_event_size`: oversized
headers) with a plain 400 and closes the socket with the rest of the request unread, which the kernel
turns into a reset: most clients see the reset, not the answer. Here such a request gets 431 (Request
Header Fields Too Large; any other unparsable one 400) with OpenAI's error object, and the connection is
closed as servers do it (nginx's lingering close): the writing side first, then, once the client closed
its own or LINGER_S passed, the whole of it, reading and dropping what comes meanwhile.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE, H11Protocol

LINGER_S = 2.0
"""How long a refused connection is read (and what comes dropped) before it is closed."""


class ErrorAnsweringH11(H11Protocol):
    """uvicorn's h11 protocol, with the refusal of an unparsable request as the module says."""

    _lingering = False

    def data_received(self, data: bytes) -> None:
        if not self._lingering:  # lingering: the refused request's rest, dropped
            super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        """(uvicorn's hook for a request h11 cannot parse.) 431 or 400, then the lingering close."""
        limit = self.config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
        too_long = len(self.conn.trailing_data[0]) > limit  # h11 waits for the end of a head
        status, message, code = (
            (431, f"The request's headers are over {limit:,} bytes.", "request_header_fields_too_large")
            if too_long
            else (400, "Invalid HTTP request.", "invalid_http_request")
        )
        error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
        body = json.dumps({"error": error}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        for event in (h11.Response(status_code=status, headers=headers), h11.Data(data=body)):
            self.transport.write(self.conn.send(event))
        self.transport.write(self.conn.send(h11.EndOfMessage()) or b"")
        self._lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

    def eof_received(self) -> None:
        if self._lingering:  # the client read the answer and closed its side
            self.transport.close()
            return
        super().eof_received()

    def shutdown(self) -> None:
        if self._lingering:
            self.transport.close()
            return
        super().shutdown()
