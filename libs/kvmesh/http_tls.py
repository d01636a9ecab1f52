"""HTTPS with the service's mTLS identity on its HTTP ports, and who the HTTP peer is.

Why it exists: gRPC hops run mutual TLS with SPIFFE identities (``kvmesh.rpc.tls``,
``kvmesh.rpc.authz``), but the workers' OpenAI HTTP API, the router's front door and every
``/metrics`` page were plaintext and open to anyone on the network. This module gives those
ports the same certificate files (reloaded on change, no restart) and tells the app which
fleet identity, if any, is on the other end:

* ``ServerSsl``: an ``ssl.SSLContext`` over a ``TlsConfig``'s files. A client certificate is
  *optional* at the TLS layer (``CERT_OPTIONAL``) so that probes without one (kubelet's
  ``httpGet`` on ``/health``) still connect; one that is presented must chain to the CA. Each
  app then decides per path who may call (``RequireRoles``, the router's request scope).
* ``peer_aware(protocol_class)``: uvicorn's HTTP protocol that puts the peer's leaf certificate
  in the ASGI scope (the ASGI TLS extension, ``scope["extensions"]["tls"]``).
* ``RequireRoles``: ASGI middleware admitting only peers whose SPIFFE role is listed (every path
  but the public ones); no certificate is 401, a wrong role 403, as OpenAI-shaped JSON.
"""

from __future__ import annotations

import json
import logging
import ssl
from collections.abc import Iterable
from typing import Any

from kvmesh.rpc.authz import Identity, identity_from_pem
from kvmesh.rpc.tls import CertFiles, Material, TlsConfig

log = logging.getLogger(__name__)

HTTP_TLS_MODES = ("auto", "on", "off")


def http_tls_enabled(mode: str, tls: TlsConfig) -> bool:
    """``auto`` = on exactly when the service's gRPC mutual TLS is on."""
    if mode not in HTTP_TLS_MODES:
        raise ValueError(f"http tls mode must be one of {HTTP_TLS_MODES}, got {mode!r}")
    return mode == "on" or (mode == "auto" and tls.enabled())


class ServerSsl:
    """A server ``SSLContext`` that follows the certificate files (checked at each handshake,
    at most every ``tls_reload_s``); a half-written rotation is never loaded."""

    def __init__(self, cfg: TlsConfig, require_client_cert: bool = False) -> None:
        self.cfg = cfg
        self.files = CertFiles(cfg)
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        self.ctx.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_OPTIONAL
        self._load(self.files.material)
        # Called at every ClientHello (with or without SNI): the cheap place to look for new files.
        self.ctx.sni_callback = self._on_hello

    def _load(self, m: Material) -> None:
        self.ctx.load_cert_chain(self.cfg.tls_cert, self.cfg.tls_key)
        # A CA added to the bundle is trusted from now on; dropping one needs a restart (documented).
        self.ctx.load_verify_locations(cadata=m.ca.decode())

    def _on_hello(self, _sock: Any, _name: str | None, _ctx: Any) -> None:
        new = self.files.poll()
        if new is None:
            return None
        try:
            self._load(new)
        except (ssl.SSLError, OSError, ValueError) as exc:   # replaced again while we read it
            log.warning("HTTPS certificate reload failed; keeping the old one", extra={"error": str(exc)})
        return None


def peer_pem(ssl_object: Any) -> str | None:
    """The peer's leaf certificate (PEM) of a TLS connection, None without one."""
    if ssl_object is None:
        return None
    der = ssl_object.getpeercert(binary_form=True)
    return ssl.DER_cert_to_PEM_cert(der) if der else None


def peer_aware(base: type) -> type:
    """``base`` (uvicorn's httptools protocol or a subclass) putting the peer's certificate in
    every request's scope: ``scope["extensions"]["tls"]["client_cert_chain"] == [PEM]``."""

    class PeerAwareProtocol(base):  # type: ignore[misc, valid-type]
        _kvmesh_peer_pem: str | None = None

        def connection_made(self, transport: Any) -> None:
            self._kvmesh_peer_pem = peer_pem(transport.get_extra_info("ssl_object"))
            super().connection_made(transport)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._kvmesh_peer_pem is not None:
                self.scope["extensions"] = {"tls": {"client_cert_chain": [self._kvmesh_peer_pem]}}

    PeerAwareProtocol.__name__ = f"PeerAware{base.__name__}"
    return PeerAwareProtocol


def scope_identity(scope: dict[str, Any]) -> Identity | None:
    """The SPIFFE identity of the certificate the HTTP peer presented, None without one."""
    chain = ((scope.get("extensions") or {}).get("tls") or {}).get("client_cert_chain") or []
    return identity_from_pem(chain[0].encode()) if chain else None


def roles_list(text: str) -> frozenset[str]:
    return frozenset(r.strip() for r in text.split(",") if r.strip())


async def send_json(send: Any, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


def error_body(message: str, etype: str, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": etype, "param": None, "code": code}}


class RequireRoles:
    """ASGI middleware: every path but ``public`` needs a client certificate of ``trust_domain``
    whose role is one of ``roles``; refused before the app (or the body) is touched."""

    def __init__(self, app: Any, roles: Iterable[str], trust_domain: str,
                 public: Iterable[str] = ("/health",), extra: dict[str, frozenset[str]] | None = None) -> None:
        self.app = app
        self.roles = frozenset(roles)
        self.extra = extra or {}   # path -> roles also allowed there (e.g. monitor on /metrics)
        self.trust_domain = trust_domain
        self.public = frozenset(public)
        self.refused = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("path", "") not in self.public:
            ident = scope_identity(scope)
            problem = None
            if ident is None:
                status, etype, problem = 401, "authentication_error", (
                    "a client certificate of the fleet (mutual TLS) is required")
            elif ident.trust_domain != self.trust_domain or (
                    ident.role not in self.roles and ident.role not in self.extra.get(scope.get("path", ""), ())):
                status, etype, problem = 403, "permission_error", (
                    f"identity {ident.uri} may not call this API (roles allowed: {', '.join(sorted(self.roles))})")
            if problem is not None:
                self.refused += 1
                log.warning("http request refused", extra={"path": scope.get("path", ""), "reason": problem,
                                                           "client": str(scope.get("client"))})
                await send_json(send, status, error_body(problem, etype, status))
                return
        await self.app(scope, receive, send)
