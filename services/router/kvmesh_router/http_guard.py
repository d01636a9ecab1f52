"""The router's HTTP front door guards: authentication before the body, and bounded connections.

Why it exists: the router faces clients it does not trust. Two layers:

* ``ScopeMiddleware`` (ASGI): every path but ``/health`` gets its request scope
  (``request_scope``: key -> tenant -> deadline) from the headers alone; a request
  without a valid key is answered 401 before a byte of its body is read - in
  Anthropic's error shape under ``/v1/messages``, OpenAI's elsewhere - with
  ``connection: close``, so the unread body is not waited for. Any exception a
  handler lets escape becomes a JSON 500, never uvicorn's plain text.
* ``guarded_protocol`` (uvicorn's httptools protocol): a cap on open connections
  (503 JSON, closed), a deadline for the request line and headers of each request from
  its first byte (408 JSON, closed: no half-sent request holds a connection forever; a
  connection that sends nothing is closed after the idle kept-alive bound) and a cap on
  their size (431); bytes that are not HTTP get a JSON 400 too. The body's size and read time are bounded where it is read
  (``kvmesh.openai.requests.read_body``: 413 at the limit, chunked or not; 408).
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvmesh.anthropic.errors import AnthropicError
from kvmesh.http_tls import scope_identity
from kvmesh.openai.errors import error_body
from kvmesh_router import metrics
from kvmesh_router.request_scope import PUBLIC_PATHS, RequestScopes, Scope, Unauthenticated

if TYPE_CHECKING:
    from fastapi import Request

log = logging.getLogger(__name__)

ANTHROPIC_PREFIX = "/v1/messages"
SCOPE_KEY = "kvmesh_scope"
# Answers given before the request body was all read (too large, too slow).
CLOSE_AFTER = frozenset({408, 413})


def _error(path: str, status: int, message: str, etype: str | None = None) -> bytes:
    if path.startswith(ANTHROPIC_PREFIX):
        return json.dumps(AnthropicError(message, status, etype).body()).encode()
    return json.dumps(error_body(status, message, etype)).encode()


async def _send_json(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class ScopeMiddleware:
    """Authenticate each request from its headers and hang its ``Scope`` on ``request.state``."""

    def __init__(self, app: Any, scopes: RequestScopes) -> None:
        self.app = app
        self.scopes = scopes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if path not in PUBLIC_PATHS:
            headers: dict[str, str] = {}
            for k, v in scope.get("headers") or ():
                headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
            try:
                rs = self.scopes.scope(headers.get, peer=scope_identity(scope))
            except Unauthenticated as exc:
                metrics.REQUESTS.labels(api="http", outcome="unauthenticated").inc()
                hdrs = [(b"www-authenticate", b'Bearer realm="kvmesh"')]
                if scope.get("method") != "GET":
                    hdrs.append((b"connection", b"close"))   # do not wait for a body nobody will read
                await _send_json(send, 401, _error(path, 401, str(exc), "authentication_error"), hdrs)
                return
            scope.setdefault("state", {})[SCOPE_KEY] = rs
        started = False

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] in CLOSE_AFTER:
                    # The body was not all read: close rather than read (and drop) the rest of it.
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:   # never uvicorn's plain-text 500
            log.exception("unhandled error in an HTTP handler", extra={"path": path})
            if not started:
                await _send_json(send, 500, _error(path, 500, f"internal error: {type(exc).__name__}"),
                                 [(b"connection", b"close")])


def _raw_response(status: int, reason: str, body: bytes) -> bytes:
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode() + body


_refusals: dict[str, Any] = {"next": 0.0, "count": 0}


def _log_refusal(outcome: str, client: Any) -> None:
    """Log refused requests (at most one line per 5 s, with the count since the last): a
    client that lost requests to the router must find them in its log, and a flood must not
    flood it."""
    _refusals["count"] += 1
    now = time.monotonic()
    if now >= _refusals["next"]:
        log.warning("HTTP request refused", extra={"outcome": outcome, "client": client,
                                                   "refused_since_last_line": _refusals["count"]})
        _refusals["next"], _refusals["count"] = now + 5.0, 0


def guarded_protocol(max_connections: int, header_timeout_s: float, max_header_bytes: int,
                     idle_timeout_s: float = 65.0) -> type:
    """uvicorn's httptools protocol with a connection cap, a header deadline (from the request's
    first byte), a bound on a new connection that sends nothing (``idle_timeout_s``, the
    kept-alive bound) and a header size cap."""

    class GuardedHttpTools(HttpToolsProtocol):
        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._hdr_bytes = 0
            self._in_headers = True
            self._hdr_timer = None
            if len(self.connections) > max_connections:
                metrics.REQUESTS.labels(api="http", outcome="too_many_connections").inc()
                self._refuse(503, "Service Unavailable",
                             f"too many open connections (over {max_connections}); retry later")
                return
            # Nothing sent yet: an idle connection, bounded like an idle kept-alive one. The
            # header deadline starts at the request's first byte (on_message_begin). Counted
            # from the accept, it charged the client's own delay before sending: a soak client
            # starved of CPU connected, sent 10 s later, and lost its request (408, then a reset
            # as it wrote: ReadError, errno 32, at the client).
            self._arm(idle_timeout_s, self._idle_timeout)

        def _arm(self, delay_s: float, fn: Any) -> None:
            self._disarm()
            if delay_s > 0:
                self._hdr_timer = self.loop.call_later(delay_s, fn)

        def _disarm(self) -> None:
            if self._hdr_timer is not None:
                self._hdr_timer.cancel()
                self._hdr_timer = None

        def _refuse(self, status: int, reason: str, message: str) -> None:
            self._disarm()
            self._in_headers = False
            if not self.transport.is_closing():
                self.transport.write(_raw_response(status, reason, json.dumps(error_body(status, message)).encode()))
                self.transport.close()

        def _header_timeout(self) -> None:
            self._hdr_timer = None
            if self._in_headers and not self.transport.is_closing():
                metrics.REQUESTS.labels(api="http", outcome="header_timeout").inc()
                _log_refusal("header_timeout", self.client)
                self._refuse(408, "Request Timeout", f"request headers not received within {header_timeout_s:g} s")

        def _idle_timeout(self) -> None:
            self._hdr_timer = None
            if self._in_headers and self._hdr_bytes == 0 and not self.transport.is_closing():
                self.transport.close()   # as uvicorn closes an idle kept-alive connection

        def data_received(self, data: bytes) -> None:
            if self._in_headers:
                self._hdr_bytes += len(data)
                if self._hdr_bytes > max_header_bytes + 65536:
                    # Checked per read as well as per header: a huge single header never completes.
                    self._refuse(431, "Request Header Fields Too Large",
                                 f"request line and headers over {max_header_bytes} bytes")
                    return
            if self.transport.is_closing():
                return
            super().data_received(data)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if not self._in_headers:   # the next request on a kept-alive connection
                self._in_headers = True
                self._hdr_bytes = 0
            # The request's first byte is in: its headers have header_timeout_s from now.
            self._arm(header_timeout_s, self._header_timeout)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._hdr_size = getattr(self, "_hdr_size", 0) + len(name) + len(value)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._disarm()
            self._in_headers = False
            size = getattr(self, "_hdr_size", 0) + len(self.url)
            self._hdr_size = 0
            if size > max_header_bytes:
                self._refuse(431, "Request Header Fields Too Large",
                             f"request line and headers over {max_header_bytes} bytes")
                return
            super().on_headers_complete()

        def send_400_response(self, msg: str) -> None:
            # uvicorn's answer to bytes that are not HTTP: JSON like every other error.
            self._refuse(400, "Bad Request", f"malformed HTTP request: {msg}")

        def on_body(self, body: bytes) -> None:
            if self.cycle is None or self.transport.is_closing():
                return   # refused before the request reached the app
            super().on_body(body)

        def on_message_complete(self) -> None:
            if self.cycle is None or self.transport.is_closing():
                return
            super().on_message_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedHttpTools


def request_scope_of(request: Request) -> Scope:
    """The scope ``ScopeMiddleware`` set (the app always runs behind it)."""
    sc = request.scope.get("state", {}).get(SCOPE_KEY)
    if sc is None:
        raise RuntimeError("request without a scope: the app must run behind ScopeMiddleware")
    return sc
