"""API keys: who a caller is (its tenant) from the key it presents, and each tenant's secret cache salt.

Why it exists: several teams share one fleet and their prompts are source code. The
tenant a request is served as - and so the prefix cache it may hit - must come from a
credential the server checks, never from what the client says about itself; and the
cache salt that separates tenants must be a secret, not ``tenant:<id>``.

Keys file (a plain file, or a directory such as a mounted Kubernetes Secret, whose
regular files are all read): one key per line, ``#`` comments::

    # tenant     key                              flags
    team-a       sha256:9f86d081884c7d659a2feaa0
    team-b       kvm-3q2...                       (a plain key: hashed on load, never kept)
    old-gw       sha256:...                       trusted   (accepted, grants nothing)

Only SHA-256 digests of the keys are kept in memory, and a presented key is hashed
and looked up, so the file may hold digests only (``kvmesh auth add-key`` writes
them). A request's tenant is its key's. The ``trusted`` flag is still parsed (old files
load) but the router ignores it: only a gateway's mTLS identity (``--trusted-gateways``)
may name the tenant (issue #20). The file is re-read when it changes (checked at most every
``reload_s`` on use); a file that no longer parses keeps the previous keys and logs
an error, so a bad edit does not lock everyone out.

Salts: ``HMAC-SHA256(server secret, tenant)``; a client's own ``cache_salt`` (to keep
some of its requests apart) is mixed into the tenant's, never used instead.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

KEY_PREFIX = "kvm-"
DIGEST_PREFIX = "sha256:"
TRUSTED = "trusted"
# A presented key longer than this is not a key (and is not hashed).
MAX_KEY_BYTES = 512


class KeyFileError(ValueError):
    """The keys file does not parse; the message names the file and line."""


def digest(key: str) -> str:
    """The stored form of a key: ``sha256:<hex>``."""
    return DIGEST_PREFIX + hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    """A fresh random key (256 bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class Principal:
    """Who presented a valid key: its tenant, and whether it is a trusted gateway."""

    tenant: str
    trusted: bool = False
    key_id: str = ""    # the first hex digits of the key's digest: names the key in logs, never reveals it


def parse_keys(text: str, source: str = "<keys>") -> dict[str, Principal]:
    """Digest -> principal, from the keys-file format (see the module doc)."""
    out: dict[str, Principal] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) < 2:
            raise KeyFileError(f"{source}:{n}: expected 'TENANT KEY [trusted]'")
        tenant, key, flags = parts[0], parts[1], parts[2:]
        bad = [f for f in flags if f != TRUSTED]
        if bad:
            raise KeyFileError(f"{source}:{n}: unknown flag {bad[0]!r} (known: {TRUSTED})")
        if key.startswith(DIGEST_PREFIX):
            hexd = key[len(DIGEST_PREFIX):].lower()
            if len(hexd) != 64 or any(c not in "0123456789abcdef" for c in hexd):
                raise KeyFileError(f"{source}:{n}: a sha256 digest is 64 hex digits")
            d = DIGEST_PREFIX + hexd
        else:
            d = digest(key)
        if d in out and out[d].tenant != tenant:
            raise KeyFileError(f"{source}:{n}: this key is already given to tenant {out[d].tenant!r}")
        out[d] = Principal(tenant, TRUSTED in flags, d[len(DIGEST_PREFIX):][:8])
    return out


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        # A mounted Secret: the keys are files; ``..data`` and the other dot entries are its plumbing.
        return sorted(p for p in path.iterdir() if not p.name.startswith(".") and p.is_file())
    return [path]


def _signature(path: Path) -> tuple:
    """Changes whenever the keys do (a Secret update swaps the ``..data`` symlink)."""
    sig: list[object] = []
    for p in [path, *(_files(path) if path.is_dir() else [])]:
        st = p.stat()
        sig.append((str(p), st.st_mtime_ns, st.st_size, st.st_ino))
    if path.is_dir() and (path / "..data").is_symlink():
        sig.append(os.readlink(path / "..data"))
    return tuple(sig)


class ApiKeys:
    """The keys of one file or directory, reloaded when it changes. Thread-safe lookups."""

    def __init__(self, path: str | Path, reload_s: float = 1.0) -> None:
        self.path = Path(path)
        self.reload_s = reload_s
        self._lock = threading.Lock()
        self._keys: dict[str, Principal] = {}
        self._sig: tuple | None = None
        self._checked = 0.0
        self.reloads = 0
        self.reload_errors = 0
        self._load(initial=True)

    def _load(self, initial: bool = False) -> None:
        try:
            sig = _signature(self.path)
            if sig == self._sig:
                return
            keys: dict[str, Principal] = {}
            for f in _files(self.path):
                for d, p in parse_keys(f.read_text(), str(f)).items():
                    if d in keys and keys[d].tenant != p.tenant:
                        raise KeyFileError(f"{f}: a key is given to tenants {keys[d].tenant!r} and {p.tenant!r}")
                    keys[d] = p
        except (OSError, KeyFileError, UnicodeDecodeError) as exc:
            if initial:
                raise KeyFileError(f"api keys {self.path}: {exc}") from None
            self.reload_errors += 1
            log.error("api keys not reloaded; the previous keys stay in force",
                      extra={"path": str(self.path), "error": str(exc)})
            return
        with self._lock:
            self._keys, self._sig = keys, sig
        if not initial:
            self.reloads += 1
        log.info("api keys loaded", extra={"path": str(self.path), "keys": len(keys),
                                           "tenants": len({p.tenant for p in keys.values()})})

    def maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked >= self.reload_s:
            self._checked = now
            self._load()

    def lookup(self, key: str) -> Principal | None:
        """The principal of ``key``, or None when it is no valid key."""
        if not key or len(key) > MAX_KEY_BYTES:
            return None
        self.maybe_reload()
        return self._keys.get(digest(key))

    def __len__(self) -> int:
        return len(self._keys)


def key_from_headers(get) -> str:
    """The key a request presents: ``Authorization: Bearer <key>``, else ``x-api-key``.

    ``get`` reads one header (case-insensitive name); gRPC metadata uses the same names."""
    auth = get("authorization") or ""
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return (get("x-api-key") or "").strip()


class TenantSalts:
    """Secret per-tenant cache salts: ``HMAC-SHA256(secret, tenant)``, mixed with a client salt."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError("the salt secret must be at least 16 bytes")
        self._secret = secret
        self._cache: dict[tuple[str, str], str] = {}

    @classmethod
    def from_file(cls, path: str | Path) -> TenantSalts:
        return cls(Path(path).read_bytes().strip())

    def salt(self, tenant: str, client_salt: str = "") -> str:
        """The salt of ``tenant``'s requests; '' only for no tenant and no client salt (a shared cache)."""
        if not tenant and not client_salt:
            return ""
        k = (tenant, client_salt)
        s = self._cache.get(k)
        if s is None:
            # Length-prefixed, so ('ab', 'c') and ('a', 'bc') never collide.
            msg = f"{len(tenant)}:{tenant}|{client_salt}".encode()
            s = hmac.new(self._secret, msg, hashlib.sha256).hexdigest()
            if len(self._cache) > 100_000:
                self._cache.clear()
            self._cache[k] = s
        return s


def write_secret(path: str | Path) -> bytes:
    """A fresh random server secret at ``path`` (mode 0600), returned."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    secret = secrets.token_hex(32).encode()
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret + b"\n")
    return secret


def add_key(path: str | Path, tenant: str, trusted: bool = False) -> str:
    """Append a fresh key for ``tenant`` to the keys file (its digest only); the key is returned."""
    if not tenant or any(c.isspace() or c == "#" for c in tenant):
        raise ValueError(f"tenant {tenant!r}: must be non-empty, without spaces or '#'")
    key = new_key()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a") as f:
        f.write(f"{tenant} {digest(key)}{' ' + TRUSTED if trusted else ''}\n")
    return key
