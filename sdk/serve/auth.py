"""Bearer-token check for HTTP (``Authorization: Bearer T``) and gRPC (``authorization`` metadata).

The token is read once from ``--auth-token-file`` (surrounding whitespace stripped) and compared with
``hmac.compare_digest`` (constant time in the token's length). A request without a valid token gets 401 /
UNAUTHENTICATED before any model code runs; health endpoints (HTTP ``/v2/health/*``, gRPC ServerLive/ServerReady)
stay open so that orchestrators can probe without the secret. An inference call refused so is reported to
``on_denied(protocol)`` (the server counts it in ``dsedge_requests_total`` with ``model=""``).
"""
from __future__ import annotations

import hmac
import json
from pathlib import Path
from typing import Any, Callable, Iterable

from ..runtime.errors import ConfigError

_OPEN_GRPC = ("/inference.GRPCInferenceService/ServerLive", "/inference.GRPCInferenceService/ServerReady")


class TokenCheck:
    def __init__(self, token: str) -> None:
        self._token = token.encode()
        self.on_denied: Callable[[str], None] | None = None  # called with "http" or "grpc" for a refused inference

    @classmethod
    def from_file(cls, path: str | Path) -> "TokenCheck":
        """Raises ConfigError when the file is missing or empty."""
        try:
            token = Path(path).read_text().strip()
        except OSError as e:
            raise ConfigError(f"cannot read --auth-token-file {path}: {e.strerror}", "pass a readable file") from None
        if not token or any(c.isspace() for c in token):
            raise ConfigError(f"--auth-token-file {path} must hold one token without spaces",
                              "e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))' > token")
        return cls(token)

    def ok(self, header: str | bytes | None) -> bool:
        """``header`` is an ``Authorization`` value: ``Bearer <token>``, the scheme in any case (RFC 7235 §2.1)."""
        if header is None:
            return False
        got = header.encode() if isinstance(header, str) else header
        scheme, _, token = got.strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._token)

    # -- HTTP -------------------------------------------------------------------------------------------------
    def asgi(self, app: Any, open_paths: Iterable[str] = ()) -> Any:
        """Wrap an ASGI app: 401 for HTTP requests outside ``open_paths`` (prefixes) without the token."""
        prefixes = tuple(open_paths)
        check = self

        async def guarded(scope: dict, receive: Any, send: Any) -> None:
            if scope["type"] == "http" and not scope["path"].startswith(prefixes):
                header = next((v for k, v in scope.get("headers", []) if k == b"authorization"), None)
                if not check.ok(header):
                    if check.on_denied is not None and scope["path"].endswith("/infer"):
                        check.on_denied("http")
                    body = json.dumps({"error": "missing or invalid bearer token", "reason": "unauthenticated"})
                    await send({"type": "http.response.start", "status": 401,
                                "headers": [(b"content-type", b"application/json"),
                                            (b"www-authenticate", b"Bearer")]})
                    await send({"type": "http.response.body", "body": body.encode()})
                    return
            await app(scope, receive, send)

        return guarded

    # -- gRPC -------------------------------------------------------------------------------------------------
    def grpc_interceptor(self) -> Any:
        import grpc

        check = self

        async def deny(request: Any, context: Any) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token",
                                (("dsedge-reason", "unauthenticated"),))

        denied = grpc.unary_unary_rpc_method_handler(deny)

        class _Interceptor(grpc.aio.ServerInterceptor):
            async def intercept_service(self, continuation: Any, details: Any) -> Any:
                if details.method in _OPEN_GRPC:
                    return await continuation(details)
                header = next((v for k, v in (details.invocation_metadata or ()) if k == "authorization"), None)
                if check.ok(header):
                    return await continuation(details)
                if check.on_denied is not None and details.method.endswith("/ModelInfer"):
                    check.on_denied("grpc")
                return denied

        return _Interceptor()
