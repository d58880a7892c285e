"""A cap on the HTTP connections one client holds open at once (``--max-connections-per-client``).

``--max-connections`` bounds the server as a whole, so one client that opens that many connections (kept-alive
idle ones count) leaves every other client a 503. This is nginx's ``limit_conn`` keyed by ``$binary_remote_addr``:
connections are counted per peer IP address, and the one over the cap is answered ``503 Service Unavailable`` (the
JSON error body of every dsedge refusal, reason ``too_many_connections``, which tritonclient shows) with
``Connection: close`` before anything of its request is read, then closed. The response is written, the write side
shut (FIN), and what the client still sends is read and dropped until it closes or 2 s pass, so the client reads
the 503 rather than a connection reset (nginx's lingering close). Such a connection never reaches uvicorn: it takes
no ``--max-connections`` slot; it is counted as a refused request (model label empty, protocol ``http``).

Off by default, as ``limit_conn`` is: behind a load balancer or a NAT every request comes from one address. gRPC
calls are not capped per client (``--max-connections`` bounds them as ``maximum_concurrent_rpcs``). With TLS a
connection counts once its handshake is done (asyncio calls ``connection_made`` then); one that never finishes it
is closed by asyncio's handshake timeout (60 s), not counted.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Callable

from uvicorn.protocols.utils import get_remote_addr

LINGER_S = 2.0
REASON = "too_many_connections"
log = logging.getLogger("dsedge.serve")


def refusal(per_client: int) -> bytes:
    """The whole HTTP/1.1 503 response: dsedge's JSON error body (``{"error", "reason"}``, what tritonclient reads
    from a KServe v2 server's error), ``Connection: close`` and ``Retry-After: 1``."""
    body = json.dumps({"error": f"{REASON}: this client address already holds {per_client} open connections "
                                f"(--max-connections-per-client {per_client})", "reason": REASON}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"retry-after: 1\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def with_client_cap(base: type, per_client: int, on_refuse: Callable[[], None] | None = None) -> type:
    """``base`` (a uvicorn HTTP/1.1 protocol class) answering 503 to a connection whose peer address already holds
    ``per_client`` (>= 1) open connections to this listener; ``on_refuse()`` is called for each one (the server
    counts it in ``dsedge_requests_total{outcome="rejected", reason="too_many_connections"}``). One counter per class
    made: one per listener."""
    open_by_host: dict[str, int] = {}
    warned: dict[str, float] = {}
    answer = refusal(per_client)

    class ClientCapProtocol(base):  # type: ignore[misc, valid-type]
        max_per_client = int(per_client)

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._cap_host: str | None = None
            self._cap_refused = False
            addr = get_remote_addr(transport)  # uvicorn's own (ip, port); None for a Unix socket
            host = addr[0] if addr else None
            if host is not None and open_by_host.get(host, 0) >= self.max_per_client:
                self._refuse(transport, host)
                return
            if host is not None:
                open_by_host[host] = open_by_host.get(host, 0) + 1
                self._cap_host = host
            super().connection_made(transport)

        def data_received(self, data: bytes) -> None:
            if not self._cap_refused:  # a refused connection's request is read and dropped
                super().data_received(data)

        def eof_received(self) -> Any:
            if self._cap_refused:
                return None  # close once the client is done sending
            return super().eof_received()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._cap_refused:
                return
            host, self._cap_host = self._cap_host, None
            if host is not None:
                left = open_by_host.get(host, 1) - 1
                if left > 0:
                    open_by_host[host] = left
                else:
                    open_by_host.pop(host, None)
            super().connection_lost(exc)

        def _refuse(self, transport: asyncio.Transport, host: str) -> None:
            self._cap_refused = True
            if on_refuse is not None:
                on_refuse()
            transport.write(answer)
            if transport.can_write_eof():
                transport.write_eof()
            asyncio.get_event_loop().call_later(LINGER_S, transport.close)
            now = time.monotonic()
            if now - warned.get(host, -1e9) >= 10.0:  # one line per client per 10 s, not one per connection
                warned[host] = now
                log.warning("refused a connection from %s: it holds %d open connections "
                            "(--max-connections-per-client %d)", host, open_by_host.get(host, 0), self.max_per_client)

    ClientCapProtocol.__name__ = ClientCapProtocol.__qualname__ = f"ClientCap{base.__name__}"
    return ClientCapProtocol
