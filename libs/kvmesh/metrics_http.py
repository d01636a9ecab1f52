"""The ``/metrics`` port of every service, optionally over HTTPS and behind a scrape credential.

Why it exists: the metrics pages name endpoints, tenants' traffic shapes and cache hit rates, and
were served in plaintext to anyone. Prometheus can scrape with a bearer token
(``authorization.credentials_file``) or a client certificate (``tls_config``); each service
takes either (or both):

* ``--metrics-token-file``: a scrape must send ``Authorization: Bearer <the file's content>``
  (re-read when the file changes, so rotating it needs no restart);
* ``--metrics-tls on`` (``auto`` = on when the service's gRPC mTLS is on): the port speaks HTTPS
  with the service's certificate (``kvmesh.http_tls``, reloaded on change), and a client
  certificate of the fleet whose role is in ``--metrics-client-roles`` (``monitor``, ``admin``)
  may scrape.

With neither, the page is open (the previous behaviour; logged at start). ``/health`` always
answers without a credential, for kubelet and load balancers. A refused scrape is a JSON 401
(no or wrong credential) or 403 (a certificate of another role).
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import socket
import ssl
import threading
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, CollectorRegistry, make_wsgi_app

from kvmesh.config import ConfigError
from kvmesh.http_tls import HTTP_TLS_MODES, ServerSsl, error_body, http_tls_enabled, peer_pem, roles_list
from kvmesh.rpc.authz import identity_from_pem
from kvmesh.rpc.tls import TlsConfig

log = logging.getLogger(__name__)

# Nested in every service config with the bare ``--metrics-*`` flag names and ``<PREFIX>METRICS_*`` env names.
METRICS_AUTH_METADATA: dict[str, Any] = {"flag_prefix": "", "env_prefix": "", "group": "metrics scrape auth",
                                         "help": "who may read /metrics (see docs/security.md)"}


@dataclass
class MetricsAuthConfig:
    metrics_tls: str = field(default="off", metadata={
        "help": "serve /metrics over HTTPS with the service's certificate: on | off | auto (= on with gRPC mTLS)",
        "choices": list(HTTP_TLS_MODES)})
    metrics_token_file: str = field(default="", metadata={
        "help": "file holding a bearer token a scrape must send (Authorization: Bearer ...); re-read on change"})
    metrics_client_roles: str = field(default="monitor,admin", metadata={
        "help": "with metrics TLS on, client-certificate roles that may scrape ('' = certificates grant nothing)"})

    def validate(self) -> None:
        if self.metrics_tls not in HTTP_TLS_MODES:
            raise ConfigError(f"setting 'metrics_tls': {self.metrics_tls!r} is not one of {', '.join(HTTP_TLS_MODES)}")
        if self.metrics_token_file and not os.path.isfile(self.metrics_token_file):
            raise ConfigError(f"setting 'metrics_token_file': no such file {self.metrics_token_file!r}")


class TokenFile:
    """A bearer token kept in a file, re-read when the file's stat signature changes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._sig: tuple[int, int, int] | None = None
        self._token = b""
        self._lock = threading.Lock()
        self.current()
        if not self._token:
            raise ConfigError(f"metrics token file {path!r} is empty")

    def current(self) -> bytes:
        try:
            st = os.stat(self.path)
        except OSError:
            return self._token          # gone for a moment (a rotation): keep the last one
        sig = (st.st_mtime_ns, st.st_size, st.st_ino)
        with self._lock:
            if sig != self._sig:
                token = open(self.path, "rb").read().strip()
                if token:
                    self._token, self._sig = token, sig
            return self._token

    def matches(self, header: str) -> bool:
        scheme, _, value = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), self.current())


@dataclass
class ScrapeGuard:
    """Who may read the page: a bearer token, and/or client certificates with given roles."""

    token: TokenFile | None = None
    roles: frozenset[str] = frozenset()     # empty: certificates grant nothing
    trust_domain: str = ""
    refused: int = 0

    @property
    def open(self) -> bool:
        return self.token is None and not self.roles

    def check(self, authorization: str, pem: str | None) -> tuple[int, str] | None:
        """None = allowed, else (status, message)."""
        if self.open:
            return None
        if self.token is not None and authorization and self.token.matches(authorization):
            return None
        if pem and self.roles:
            ident = identity_from_pem(pem.encode())
            if ident is not None and ident.trust_domain == self.trust_domain and ident.role in self.roles:
                return None
            if ident is not None:
                return 403, f"identity {ident.uri} may not read metrics"
        return 401, "metrics need a credential: " + " or ".join(
            ([] if self.token is None else ["Authorization: Bearer <token>"])
            + ([] if not self.roles else [f"a client certificate with role {'/'.join(sorted(self.roles))}"]))


def guarded_app(registry: CollectorRegistry, guard: ScrapeGuard) -> Any:
    inner = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Any) -> Any:
        if environ.get("PATH_INFO") == "/health":
            start_response("200 OK", [("Content-Type", "application/json")])
            return [b'{"status": "ok"}']
        refusal = guard.check(environ.get("HTTP_AUTHORIZATION", ""), environ.get("kvmesh.peer_pem"))
        if refusal is not None:
            guard.refused += 1
            status, message = refusal
            etype = "authentication_error" if status == 401 else "permission_error"
            start_response(f"{status} {'Unauthorized' if status == 401 else 'Forbidden'}",
                           [("Content-Type", "application/json"), *([("WWW-Authenticate", "Bearer")]
                                                                   if status == 401 else [])])
            return [json.dumps(error_body(message, etype, status)).encode()]
        return inner(environ, start_response)
    return app


class _Handler(WSGIRequestHandler):
    timeout = 10   # a connection that sends nothing (or stalls its TLS handshake) is dropped

    def get_environ(self) -> dict[str, Any]:
        env = super().get_environ()
        conn = self.connection
        env["kvmesh.peer_pem"] = peer_pem(conn) if isinstance(conn, ssl.SSLSocket) else None
        return env

    def log_message(self, *args: Any) -> None:   # scrapes are not worth a log line each
        pass


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    address_family = socket.AF_INET

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A failed handshake (no or a foreign certificate, plaintext to HTTPS) or a dropped scrape.
        log.debug("metrics connection failed", extra={"client": str(client_address)}, exc_info=True)


class _Server6(_Server):
    address_family = socket.AF_INET6


def serve_metrics(port: int, host: str, registry: CollectorRegistry | None = None,
                  auth: MetricsAuthConfig | None = None, tls: TlsConfig | None = None) -> int:
    """Serve ``registry`` at ``/metrics`` (and an open ``/health``) on ``host:port`` in a daemon
    thread; returns the bound port (``port`` 0 binds a free one)."""
    auth = auth or MetricsAuthConfig()
    tls_cfg = tls if tls is not None else TlsConfig(tls="off")
    https = http_tls_enabled(auth.metrics_tls, tls_cfg)
    if https and not tls_cfg.enabled():
        raise ConfigError("--metrics-tls on needs the service's certificate (--tls-cert, --tls-key, --tls-ca)")
    guard = ScrapeGuard(TokenFile(auth.metrics_token_file) if auth.metrics_token_file else None,
                        roles_list(auth.metrics_client_roles) if https else frozenset(), tls_cfg.tls_trust_domain)
    server_class = _Server6 if ":" in host else _Server
    httpd = make_server(host, port, guarded_app(registry or REGISTRY, guard), server_class, _Handler)
    if https:
        # The handshake happens in the request's thread (on its first read), never in accept().
        httpd.socket = ServerSsl(tls_cfg).ctx.wrap_socket(httpd.socket, server_side=True,
                                                           do_handshake_on_connect=False)
    threading.Thread(target=httpd.serve_forever, name=f"metrics-{port}", daemon=True).start()
    bound = httpd.server_address[1]
    if guard.open:
        log.warning("/metrics is open to anyone who reaches it (--metrics-token-file or --metrics-tls to "
                    "require a scrape credential)", extra={"port": bound})
    log.info("metrics served", extra={"port": bound, "https": https, "token": guard.token is not None,
                                      "roles": sorted(guard.roles)})
    return bound
