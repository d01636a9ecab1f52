"""Authorization by role: which service identity may call which gRPC method, and as whom.

Why it exists: with mutual TLS every peer is *some* member of the fleet, but a compromised or
misconfigured member must not be able to steer routing. Before this table, any client could
``RegisterEndpoint`` with another endpoint's id and receive its prompts, wipe the index with
``DeregisterEndpoint``, or bend routing with ``PutSpeculative``.

A peer's identity is the SPIFFE URI SAN of its client certificate,
``spiffe://<trust-domain>/<role>/<id>`` (``kvmesh certs`` and the cert-manager manifests issue
these). The rules:

* only workers and stores register, heartbeat and publish events, and only as themselves
  (the request's endpoint id must equal the certificate's id);
* only routers write speculative entries and call workers' Generate/Prefill/Abort;
* only an admin deregisters an endpoint; an endpoint leaving at shutdown ends its own
  registration with ``Heartbeat(leaving=true)`` (the Heartbeat rule: only as itself), which
  expires it as a missed TTL would;
* the offload store's data methods serve workers (and admin);
* Envoy's ext_proc calls come from the ``gateway`` role;
* every other method (reads such as Lookup, ListEndpoints, Stats, GetLoad, the router's
  Generate) needs any valid identity of the trust domain; health checks need none.

A refusal is ``PERMISSION_DENIED`` and happens before the servicer runs, so it changes no state.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvmesh.rpc.tls import DEFAULT_TRUST_DOMAIN, peer_identity_pem

log = logging.getLogger(__name__)

ROLES = ("router", "worker", "store", "indexer", "gateway", "admin", "client", "monitor")
ADMIN = "admin"
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


@dataclass(frozen=True)
class Identity:
    trust_domain: str
    role: str
    id: str

    @property
    def uri(self) -> str:
        return f"spiffe://{self.trust_domain}/{self.role}/{self.id}"


def spiffe_uri(trust_domain: str, role: str, ident: str) -> str:
    return Identity(trust_domain, role, ident).uri


def parse_spiffe(uri: str) -> Identity | None:
    """``spiffe://DOMAIN/ROLE/ID`` -> Identity; anything else (or an unknown role) -> None."""
    if not uri.startswith("spiffe://"):
        return None
    domain, _, path = uri[len("spiffe://"):].partition("/")
    role, _, ident = path.partition("/")
    if not domain or role not in ROLES or not ident or "/" in ident:
        return None
    return Identity(domain, role, ident)


@functools.lru_cache(maxsize=4096)
def identity_from_pem(pem: bytes) -> Identity | None:
    """The SPIFFE identity of a PEM certificate (exactly one spiffe URI SAN), else None."""
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(pem)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return None
    uris = [u for u in san.get_values_for_type(x509.UniformResourceIdentifier) if u.startswith("spiffe://")]
    return parse_spiffe(uris[0]) if len(uris) == 1 else None


def peer_identity(context: Any) -> Identity | None:
    pem = peer_identity_pem(context)
    return identity_from_pem(bytes(pem)) if pem else None


@dataclass(frozen=True)
class Rule:
    """Roles allowed to call a method; ``self_of`` names the endpoint id the request acts on,
    which must be the caller's own id unless the caller's role is in ``any_id_roles``."""

    roles: frozenset[str]
    self_of: Callable[[Any], str] | None = None
    any_id_roles: frozenset[str] = field(default_factory=frozenset)


def _rule(*roles: str, self_of: Callable[[Any], str] | None = None, any_id: tuple[str, ...] = ()) -> Rule:
    return Rule(frozenset(roles), self_of, frozenset(any_id))


_IDX = "/kvmesh.indexer.v1.Indexer/"
_WRK = "/kvmesh.worker.v1.Worker/"
_OFF = "/kvmesh.offload.v1.Offload/"

RULES: dict[str, Rule] = {
    _IDX + "RegisterEndpoint": _rule("worker", "store", self_of=lambda r: r.endpoint.endpoint_id),
    _IDX + "Heartbeat": _rule("worker", "store", self_of=lambda r: r.endpoint_id),
    _IDX + "IngestEvents": _rule("worker", "store", self_of=lambda r: r.endpoint_id),
    _IDX + "DeregisterEndpoint": _rule(ADMIN),
    _IDX + "PutSpeculative": _rule("router"),
    _WRK + "Generate": _rule("router", ADMIN),
    _WRK + "Prefill": _rule("router", ADMIN),
    _WRK + "Abort": _rule("router", ADMIN),
    **{_OFF + m: _rule("worker", ADMIN)
       for m in ("Put", "Get", "Contains", "PutShm", "GetShm", "ReleaseShm", "GetBulk", "ReservePut", "CommitPut")},
    _OFF + "Delete": _rule("worker", ADMIN),
    "/envoy.service.ext_proc.v3.ExternalProcessor/Process": _rule("gateway", ADMIN),
}


class Denied(Exception):
    pass


@dataclass
class Authorizer:
    trust_domain: str = DEFAULT_TRUST_DOMAIN
    rules: dict[str, Rule] = field(default_factory=lambda: dict(RULES))
    denied: int = 0

    def caller(self, method: str, context: Any) -> Identity:
        ident = peer_identity(context)
        if ident is None:
            raise Denied("no SPIFFE identity in the client certificate")
        if ident.trust_domain != self.trust_domain:
            raise Denied(f"identity {ident.uri} is not in trust domain {self.trust_domain!r}")
        rule = self.rules.get(method)
        if rule is not None and ident.role not in rule.roles:
            raise Denied(f"role {ident.role!r} may not call {method}")
        return ident

    def check_request(self, method: str, ident: Identity, request: Any) -> None:
        rule = self.rules.get(method)
        if rule is None or rule.self_of is None or ident.role in rule.any_id_roles:
            return
        target = rule.self_of(request)
        if target != ident.id:
            raise Denied(f"{ident.uri} may act only as endpoint {ident.id!r}, not {target!r}")

    def deny(self, method: str, context: Any, exc: Denied) -> None:
        self.denied += 1
        log.warning("permission denied", extra={"method": method, "reason": str(exc),
                                                "peer": _peer(context)})


def _peer(context: Any) -> str:
    try:
        return str(context.peer())
    except Exception:  # noqa: BLE001
        return ""


async def _result(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class AuthzInterceptor(grpc.aio.ServerInterceptor):
    """Checks every call against an :class:`Authorizer` before the servicer sees it."""

    def __init__(self, authorizer: Authorizer | None = None) -> None:
        self.authz = authorizer or Authorizer()

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        return _wrap(handler, method, self.authz)


def _wrap(h: grpc.RpcMethodHandler, method: str, az: Authorizer) -> grpc.RpcMethodHandler:
    async def admit(context: Any, request: Any = None, with_request: bool = False) -> Identity:
        try:
            ident = az.caller(method, context)
            if with_request:
                az.check_request(method, ident, request)
            return ident
        except Denied as exc:
            az.deny(method, context, exc)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
            raise  # unreachable: abort raises

    def checked_stream(ident: Identity, it: Any, context: Any) -> Any:
        async def gen() -> Any:
            async for req in it:
                try:
                    az.check_request(method, ident, req)
                except Denied as exc:
                    az.deny(method, context, exc)
                    await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
                yield req
        return gen()

    kw = {"request_deserializer": h.request_deserializer, "response_serializer": h.response_serializer}
    if h.unary_unary is not None:
        async def uu(request: Any, context: Any) -> Any:
            await admit(context, request, True)
            return await _result(h.unary_unary(request, context))
        return grpc.unary_unary_rpc_method_handler(uu, **kw)
    if h.unary_stream is not None:
        async def us(request: Any, context: Any) -> Any:
            await admit(context, request, True)
            res = h.unary_stream(request, context)
            if inspect.isasyncgen(res) or hasattr(res, "__aiter__"):
                async for item in res:
                    yield item
            else:
                await _result(res)
        return grpc.unary_stream_rpc_method_handler(us, **kw)
    if h.stream_unary is not None:
        async def su(request_iterator: Any, context: Any) -> Any:
            ident = await admit(context)
            return await _result(h.stream_unary(checked_stream(ident, request_iterator, context), context))
        return grpc.stream_unary_rpc_method_handler(su, **kw)

    async def ss(request_iterator: Any, context: Any) -> Any:
        ident = await admit(context)
        res = h.stream_stream(checked_stream(ident, request_iterator, context), context)
        if inspect.isasyncgen(res) or hasattr(res, "__aiter__"):
            async for item in res:
                yield item
        else:
            await _result(res)
    return grpc.stream_stream_rpc_method_handler(ss, **kw)
