"""Leases on store memory as capability tokens bound to the caller.

Why: a lease lets a client read blocks in place (GetShm ``map_store``) or over
the bulk TCP port (GetBulk), and keeps their memory from being reused until it
ends. Sequential ids were guessable: one guess read another client's blocks,
and anyone could end anyone's lease. A lease is now a random 128-bit token
(``secrets.token_bytes``), remembered together with who asked for it: the
caller's authenticated identity when the channel has one (mTLS), and its host.
Only the same caller may end it, and the bulk port hands the bytes only to a
connection from that host. A wrong token, or the right token from someone
else, is the same answer as an expired lease and changes nothing.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from kvmesh.rpc.authz import peer_identity
from kvmesh.rpc.peers import normalize_host, peer_host

TOKEN_BYTES = 16


@dataclass(frozen=True, slots=True)
class Caller:
    """Who asked: an authenticated principal ("" without mTLS) and a host."""

    principal: str
    host: str


def _principal(context: Any) -> str:
    """The caller's verified certificate identity (its SPIFFE URI), or "" on a plaintext channel."""
    ident = peer_identity(context)
    return ident.uri if ident is not None else ""


def caller_of(context: grpc.aio.ServicerContext) -> Caller:
    return Caller(_principal(context), peer_host(context.peer() or ""))


class LeaseTable:
    """Token -> (held value, caller, expiry). Thread-safe; expired entries are swept lazily."""

    def __init__(self, ttl_s: float, bind_host: bool = True, now: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.bind_host = bind_host
        self._now = now
        self._lock = threading.Lock()
        self._leases: dict[bytes, tuple[Any, Caller, float]] = {}
        self.refused = 0   # release or take attempts with an unknown token or by another caller

    def add(self, value: Any, caller: Caller) -> bytes:
        self.sweep()
        token = secrets.token_bytes(TOKEN_BYTES)
        with self._lock:
            self._leases[token] = (value, caller, self._now() + self.ttl_s)
        return token

    def sweep(self) -> None:
        """Drop expired leases (a reader that died never releases)."""
        now = self._now()
        with self._lock:
            for tok in [t for t, (_, _, exp) in self._leases.items() if exp < now]:
                del self._leases[tok]

    def _pop_if(self, token: bytes, ok: Callable[[Caller], bool]) -> tuple[Any, bool] | None:
        """(value, still valid) if ``token`` is held and ``ok`` accepts its caller; the lease ends."""
        if len(token) != TOKEN_BYTES:
            with self._lock:
                self.refused += 1
            return None
        with self._lock:
            hit = self._leases.get(token)
            if hit is None or not ok(hit[1]):
                self.refused += 1
                return None
            del self._leases[token]
        return hit[0], hit[2] >= self._now()

    def release(self, token: bytes, caller: Caller) -> bool:
        """End a lease for its own caller; False when unknown, expired or someone else's."""
        got = self._pop_if(token, lambda owner: self._same(owner, caller))
        return got is not None and got[1]

    def take(self, token: bytes, host: str) -> Any | None:
        """The leased value for a bulk connection from ``host`` (ending the lease), or None."""
        got = self._pop_if(token, lambda owner: not self.bind_host or owner.host == normalize_host(host))
        if got is None or not got[1]:
            return None
        return got[0]

    def _same(self, owner: Caller, caller: Caller) -> bool:
        if owner.principal != caller.principal:
            return False
        return not self.bind_host or owner.host == caller.host

    def clear(self) -> None:
        with self._lock:
            self._leases.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)
