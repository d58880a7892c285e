"""A time limit on each HTTP request head: a client that opens a connection, or starts a request, and stalls before
its headers are complete holds a connection slot (``--max-connections``) for as long as it likes under uvicorn,
which times only the idle gap after a response (``timeout_keep_alive``). That is the slowloris attack
(R. Hansen, 2009; nginx's ``client_header_timeout``, Apache's ``mod_reqtimeout``): 20 sockets that sent
``POST … HTTP/1.1\\r\\nHost: x\\r\\n`` and stopped kept a ``--max-connections 20`` server answering every real
request 503 for as long as they stayed open (50 s, until the test ended).

``with_head_timeout(base, seconds)`` subclasses uvicorn's HTTP/1.1 protocol (httptools or h11): from the moment a
connection opens, or the first byte of a request after a response, the head must be complete within ``seconds``,
else the connection is closed. The body has its own limit (``--body-timeout``, sdk/serve/http.py).
"""
from __future__ import annotations

import asyncio
import importlib.util
from typing import Any


def protocol_base(http_impl: str) -> type:
    """uvicorn's HTTP/1.1 protocol class for ``http_impl`` ("auto": httptools when installed, else h11)."""
    if http_impl == "httptools" or (http_impl == "auto" and importlib.util.find_spec("httptools") is not None):
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    from uvicorn.protocols.http.h11_impl import H11Protocol

    return H11Protocol


def with_head_timeout(base: type, seconds: float) -> type:
    """``base`` (a uvicorn HTTP protocol class) closing a connection whose request head is not complete within
    ``seconds`` of the connection opening or of the request's first byte."""

    class HeadTimeoutProtocol(base):  # type: ignore[misc, valid-type]
        head_timeout_s = float(seconds)

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._head_timer: asyncio.TimerHandle | None = None
            super().connection_made(transport)
            self._arm_head_timer()

        def data_received(self, data: bytes) -> None:
            if self._between_requests():
                self._arm_head_timer()  # the first bytes of a new request: its head is timed from here
            super().data_received(data)
            if not self._between_requests():  # the head is complete: a request cycle runs
                self._cancel_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

        def _between_requests(self) -> bool:
            cycle: Any = getattr(self, "cycle", None)
            return cycle is None or cycle.response_complete

        def _arm_head_timer(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_expired)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_expired(self) -> None:
            self._head_timer = None
            if self._between_requests() and not self.transport.is_closing():
                self.transport.close()

    HeadTimeoutProtocol.__name__ = HeadTimeoutProtocol.__qualname__ = f"HeadTimeout{base.__name__}"
    return HeadTimeoutProtocol
