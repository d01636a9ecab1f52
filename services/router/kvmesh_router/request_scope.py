"""One request scope for every front door of the router: authenticate -> tenant -> deadline.

Why it exists: the OpenAI endpoints, the Anthropic Messages API and the gRPC
``Router`` service must agree on who a caller is, which tenant (and so which
secret cache salt) it is served as, and how long it may take. Each front door
used to read ``x-tenant`` and the Bearer key its own way, and ``/v1/messages``
had no deadline; here it is done once, from headers or gRPC metadata, before
any body is read.

* ``--auth keys``: a request must present a key (``Authorization: Bearer`` or
  ``x-api-key``, HTTP header or gRPC metadata) listed in the keys file
  (``kvmesh.api_keys``); else 401 / ``UNAUTHENTICATED``. Its tenant is the key's.
  A claimed tenant (the ``x-tenant`` header, the gRPC ``tenant`` field) is used
  only from a trusted gateway: a peer whose mTLS client certificate (gRPC, or the
  HTTPS front door) carries a SPIFFE id listed in ``--trusted-gateways``. Such a
  gateway authenticated its users itself, so it needs no API key; a key's
  ``trusted`` flag grants nothing (issue #20: trust comes from an identity).
* ``--auth off`` (local demo only; logged as a warning at start and on the first
  request): nobody is authenticated and a claimed tenant is taken as sent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvmesh.api_keys import ApiKeys, Principal, key_from_headers
from kvmesh.rpc.authz import Identity

log = logging.getLogger(__name__)

AUTH_MODES = ("keys", "off")
# Paths any caller may reach (load balancers probe them without a key).
PUBLIC_PATHS = frozenset({"/health"})


class Unauthenticated(Exception):
    """No key, or a key that is not valid; the message says which (never echoing the key)."""


@dataclass(frozen=True)
class Scope:
    tenant: str                      # who the request is served as ('' = no tenant: the shared cache)
    principal: Principal | None      # None with --auth off
    deadline: float | None           # time.monotonic() deadline of the whole request


class RequestScopes:
    """Builds the ``Scope`` of a request from its headers / metadata."""

    def __init__(self, auth: str, keys: ApiKeys | None, tenant_header: str = "x-tenant",
                 http_deadline_s: float = 0.0, trusted_gateways: str = "") -> None:
        if auth not in AUTH_MODES:
            raise ValueError(f"auth must be one of {AUTH_MODES}, got {auth!r}")
        if auth == "keys" and keys is None:
            raise ValueError("auth 'keys' needs an api keys file")
        self.auth = auth
        self.keys = keys if auth == "keys" else None
        self.tenant_header = tenant_header.lower()
        self.http_deadline_s = http_deadline_s
        self.gateways = tuple(g.strip() for g in trusted_gateways.split(",") if g.strip())
        for g in self.gateways:
            if not g.startswith("spiffe://"):
                raise ValueError(f"trusted gateway {g!r}: expected a SPIFFE id (spiffe://DOMAIN/ROLE/ID, ID may be *)")
        self._warned = False

    def trusts(self, peer: Identity | None) -> bool:
        """Whether ``peer`` (a verified client certificate's identity) is a configured trusted gateway."""
        if peer is None:
            return False
        uri = peer.uri
        return any(uri == g or (g.endswith("*") and uri.startswith(g[:-1])) for g in self.gateways)

    @property
    def enabled(self) -> bool:
        return self.keys is not None

    def authenticate(self, get: Callable[[str], str | None], peer: Identity | None = None) -> Principal | None:
        """The caller's principal (None with auth off); ``Unauthenticated`` when refused.

        ``peer``: the caller's mTLS identity, if it presented a certificate. A trusted gateway
        needs no key (it forwards users it authenticated); a key it forwards is still checked."""
        if self.keys is None:
            if not self._warned:
                self._warned = True
                log.warning("AUTH IS OFF: serving an unauthenticated request; tenants are taken as "
                            "clients claim them (--auth keys to require API keys)")
            return None
        key = key_from_headers(get)
        gateway = self.trusts(peer)
        if not key:
            if gateway:
                return Principal(tenant="", trusted=True, key_id=peer.uri if peer else "")
            raise Unauthenticated("missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'")
        p = self.keys.lookup(key)
        if p is None:
            raise Unauthenticated("invalid API key")
        # Trust comes from the gateway's certificate, never from the key (its 'trusted' flag is ignored).
        return Principal(p.tenant, gateway, p.key_id) if p.trusted != gateway else p

    def tenant(self, principal: Principal | None, claimed: str) -> str:
        """The tenant a request is served as: the key's, unless a trusted gateway (or auth off) names one."""
        if principal is None:
            return claimed
        if principal.trusted and claimed:
            return claimed
        if principal.trusted and not principal.tenant:
            raise Unauthenticated(f"a gateway without an API key must name the tenant ({self.tenant_header})")
        return principal.tenant

    def scope(self, get: Callable[[str], str | None], claimed_tenant: str | None = None,
              deadline_s: float | None = None, peer: Identity | None = None) -> Scope:
        """Authenticate, then the tenant, then the deadline (``deadline_s`` from now; default the HTTP one).

        ``claimed_tenant`` None = the tenant header; ``peer`` the caller's mTLS identity."""
        principal = self.authenticate(get, peer)
        claimed = (get(self.tenant_header) or "") if claimed_tenant is None else claimed_tenant
        if deadline_s is None:
            deadline_s = self.http_deadline_s or None
        deadline = time.monotonic() + deadline_s if deadline_s else None
        return Scope(self.tenant(principal, claimed), principal, deadline)


def headers_getter(headers: Any) -> Callable[[str], str | None]:
    """A header reader over Starlette headers or a plain dict (lower-case names)."""
    return headers.get


def metadata_getter(metadata: Any) -> Callable[[str], str | None]:
    """A reader over gRPC invocation metadata (a sequence of (key, value) pairs, keys lower-case)."""
    md: dict[str, str] = {}
    for k, v in metadata or ():
        if isinstance(v, str):
            md.setdefault(k.lower(), v)
    return md.get


def scopes_from_config(cfg: Any) -> RequestScopes:
    """The scopes of a router config (``auth``, ``api_keys_file``, ``tenant_header``, ``http_deadline_s``)."""
    keys = None
    if cfg.auth == "keys":
        if not cfg.api_keys_file:
            raise ValueError("auth is 'keys' but no api keys file is given (--api-keys-file, or --auth off)")
        keys = ApiKeys(cfg.api_keys_file, cfg.api_keys_reload_s)
    else:
        log.warning("AUTH IS OFF (--auth off): any client can use this router and claim any tenant; "
                    "for a local demo only")
    return RequestScopes(cfg.auth, keys, cfg.tenant_header, cfg.http_deadline_s,
                         getattr(cfg, "trusted_gateways", ""))
