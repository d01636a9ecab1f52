"""Service identity on every gRPC hop: mutual TLS from files that are reloaded when they change.

Why it exists: kvmesh runs where an attacker may share the network, so a gRPC peer must prove
who it is (a certificate from the fleet's CA, whose SPIFFE URI names its role, see
``kvmesh.rpc.authz``) and the traffic is encrypted. Certificates are short-lived and rotated in
place (cert-manager, ``kvmesh certs``), so nothing here needs a restart to pick up new files:

* servers use gRPC's *dynamic* SSL credentials, whose fetcher is asked for a new certificate
  configuration at each handshake; it answers with the files on disk once they changed (and the
  key matches the certificate, so a half-written rotation is never served);
* client channels (``ReloadingChannel``) rebuild their secure channel when the files change; the
  old channel drains its in-flight calls.

``--tls auto`` (the default) means on when a certificate, key and CA are all configured. Every
service config nests :class:`TlsConfig` (``TLS_METADATA``), so each has ``--tls``,
``--tls-cert``, ``--tls-key``, ``--tls-ca``, ... and env ``<SERVICE PREFIX>TLS_CERT`` etc.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvmesh.config import ConfigError

log = logging.getLogger(__name__)

TLS_MODES = ("auto", "on", "off")
DEFAULT_TRUST_DOMAIN = "kvmesh.local"
# A nested config field with these keeps the bare ``--tls-*`` flag names and ``<PREFIX>TLS_*`` env names.
TLS_METADATA: dict[str, Any] = {"flag_prefix": "", "env_prefix": "", "group": "mutual TLS",
                                "help": "service identity on gRPC (see docs/security.md)"}


@dataclass
class TlsConfig:
    tls: str = field(default="auto", metadata={
        "help": "mutual TLS on gRPC: on | off | auto (on when cert, key and CA are all set)",
        "choices": list(TLS_MODES)})
    tls_cert: str = field(default="", metadata={"help": "PEM certificate (chain) of this service; reloaded on change"})
    tls_key: str = field(default="", metadata={"help": "PEM private key of tls_cert; reloaded on change"})
    tls_ca: str = field(default="", metadata={"help": "PEM CA bundle trusted for peers; reloaded on change"})
    tls_server_name: str = field(default="", metadata={
        "help": "name this service's clients expect in server certificates ('' = the host dialled)"})
    tls_trust_domain: str = field(default=DEFAULT_TRUST_DOMAIN, metadata={
        "help": "SPIFFE trust domain of peer identities (spiffe://DOMAIN/ROLE/ID)"})
    tls_reload_s: float = field(default=1.0, metadata={"help": "how often the files are checked for changes"})
    tls_health_port: int = field(default=0, metadata={
        "help": "with TLS on, also serve the gRPC health service alone in plaintext on this port, for probes "
                "that cannot present a certificate (0 = off)"})
    tls_health_host: str = field(default="127.0.0.1", metadata={"help": "listen host of tls_health_port"})

    def enabled(self) -> bool:
        if self.tls == "on":
            return True
        return self.tls == "auto" and bool(self.tls_cert and self.tls_key and self.tls_ca)

    def validate(self) -> None:
        if self.tls not in TLS_MODES:
            raise ConfigError(f"setting 'tls': {self.tls!r} is not one of {', '.join(TLS_MODES)}")
        if self.tls == "on":
            missing = [n for n in ("tls_cert", "tls_key", "tls_ca") if not getattr(self, n)]
            if missing:
                raise ConfigError(f"--tls on needs {', '.join('--' + m.replace('_', '-') for m in missing)}")
        if self.enabled():
            for n in ("tls_cert", "tls_key", "tls_ca"):
                if not os.path.isfile(getattr(self, n)):
                    raise ConfigError(f"setting {n!r}: no such file {getattr(self, n)!r}")
        if self.tls_reload_s <= 0:
            raise ConfigError("setting 'tls_reload_s' must be > 0")


def plaintext() -> TlsConfig:
    return TlsConfig(tls="off")


def from_files(cert: str, key: str, ca: str, **kw: Any) -> TlsConfig:
    return TlsConfig(tls="on", tls_cert=str(cert), tls_key=str(key), tls_ca=str(ca), **kw)


# The process's own identity: set once by a service's main from its config, used by every server
# and channel that is not given one explicitly. Until then it comes from env KVMESH_TLS,
# KVMESH_TLS_CERT, ... (how a service hands its identity to processes it starts, e.g. vLLM's
# engine and its KV connector, and how the health-check command gets one); unset = plaintext.
ENV_PREFIX = "KVMESH_"
_default: TlsConfig | None = None


def set_default(cfg: TlsConfig, warn: bool = True, export: bool = False) -> None:
    """Make ``cfg`` the process's identity; ``export`` also puts it in the environment for
    child processes (a worker's vLLM engine core runs the offload connector)."""
    global _default
    _default = cfg
    if export:
        os.environ[ENV_PREFIX + "TLS"] = "on" if cfg.enabled() else "off"
        for name in ("tls_cert", "tls_key", "tls_ca", "tls_server_name", "tls_trust_domain"):
            os.environ[ENV_PREFIX + name.upper()] = str(getattr(cfg, name))
    if warn and not cfg.enabled():
        log.warning("gRPC mutual TLS is OFF: any client on the network can call this service "
                    "(--tls on with --tls-cert/--tls-key/--tls-ca to turn it on)")


def default() -> TlsConfig:
    global _default
    if _default is None:
        from kvmesh.config import load_config

        _default = load_config(TlsConfig, env_prefix=ENV_PREFIX)
    return _default


def resolve(cfg: TlsConfig | None) -> TlsConfig:
    return default() if cfg is None else cfg


# ---------------------------------------------------------------------------------------------- files
@dataclass(frozen=True)
class Material:
    cert: bytes
    key: bytes
    ca: bytes


def _stat(path: str) -> tuple[int, int, int]:
    try:
        st = os.stat(path)
    except OSError:
        return (0, 0, 0)
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def key_matches(cert_pem: bytes, key_pem: bytes) -> bool:
    """True when the first certificate of the chain holds the key's public half."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError):
        return False
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return cert.public_key().public_bytes(*fmt) == key.public_key().public_bytes(*fmt)


def issued_by_bundle(cert_pem: bytes, ca_pem: bytes) -> bool:
    """True when some certificate of the chain is signed by (or is) a certificate of the CA bundle."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    try:
        chain = x509.load_pem_x509_certificates(cert_pem)
        bundle = x509.load_pem_x509_certificates(ca_pem)
    except ValueError:
        return False
    for cert in chain:
        for ca in bundle:
            if cert == ca:
                return True
            try:
                cert.verify_directly_issued_by(ca)
                return True
            except (ValueError, TypeError, InvalidSignature):
                continue
    return False


class CertFiles:
    """The cert, key and CA files of one identity, re-read when their stat signature changes.

    ``poll()`` is cheap (three ``stat`` calls at most every ``reload_s``) and returns new material
    only once it is complete and consistent: a rotation caught between writing the certificate and
    writing its key is retried at the next poll instead of being served. When the first set's
    certificate was issued by its own CA bundle, later sets must be too, so a rotation caught with
    the new certificate and key but the old CA (files are replaced one at a time) also waits.
    """

    def __init__(self, cfg: TlsConfig) -> None:
        self.paths = (cfg.tls_cert, cfg.tls_key, cfg.tls_ca)
        self.reload_s = cfg.tls_reload_s
        self._lock = threading.Lock()
        self._sig = tuple(_stat(p) for p in self.paths)
        self._same_ca = False
        self.material = self._read()
        if self.material is None:
            raise ConfigError(f"TLS files {self.paths}: unreadable, or the key does not match the certificate")
        # Learned from the first set rather than required: a deployment whose own certificate
        # comes from another trust root than the peers' still loads.
        self._same_ca = issued_by_bundle(self.material.cert, self.material.ca)
        self._next = time.monotonic() + self.reload_s
        self.reloads = 0

    def _read(self) -> Material | None:
        try:
            cert, key, ca = (open(p, "rb").read() for p in self.paths)
        except OSError:
            return None
        if not (cert and key and ca) or not key_matches(cert, key):
            return None
        if self._same_ca and not issued_by_bundle(cert, ca):
            return None
        return Material(cert, key, ca)

    def poll(self, force: bool = False) -> Material | None:
        """New material if the files changed since the last successful load, else None."""
        now = time.monotonic()
        if not force and now < self._next:
            return None
        with self._lock:
            self._next = now + self.reload_s
            sig = tuple(_stat(p) for p in self.paths)
            if sig == self._sig:
                return None
            new = self._read()
            if new is None:
                log.warning("TLS files changed but are not a usable set yet; keeping the old ones",
                            extra={"paths": list(self.paths)})
                return None
            self._sig = sig
            if new == self.material:
                return None
            self.material = new
            self.reloads += 1
        log.info("TLS files reloaded", extra={"cert": self.paths[0], "reloads": self.reloads})
        return new


# --------------------------------------------------------------------------------------------- server
def server_credentials(cfg: TlsConfig) -> tuple[grpc.ServerCredentials, CertFiles]:
    """Credentials that require a client certificate from the CA and follow the files on disk."""
    files = CertFiles(cfg)

    def config(m: Material) -> Any:
        return grpc.ssl_server_certificate_configuration([(m.key, m.cert)], root_certificates=m.ca)

    def fetch() -> Any:
        # Called by gRPC at every handshake; None keeps the current configuration.
        new = files.poll()
        return config(new) if new is not None else None

    creds = grpc.dynamic_ssl_server_credentials(config(files.material), fetch, require_client_authentication=True)
    return creds, files


# --------------------------------------------------------------------------------------------- client
def channel_credentials(m: Material) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=m.ca, private_key=m.key, certificate_chain=m.cert)


def name_options(cfg: TlsConfig) -> list[tuple[str, object]]:
    return [("grpc.ssl_target_name_override", cfg.tls_server_name)] if cfg.tls_server_name else []


def secure_sync_channel(target: str, cfg: TlsConfig, options: list[tuple[str, object]] | None = None) -> grpc.Channel:
    """A blocking channel with the files as they are now (short-lived users: probes, tools)."""
    return grpc.secure_channel(target, channel_credentials(CertFiles(cfg).material),
                               options=[*(options or []), *name_options(cfg)])


def sync_channel(target: str, cfg: TlsConfig | None = None,
                 options: list[tuple[str, object]] | None = None) -> grpc.Channel:
    cfg = resolve(cfg)
    if not cfg.enabled():
        return grpc.insecure_channel(target, options=options)
    return secure_sync_channel(target, cfg, options)


class _MultiCallable:
    """Stands for a stub's method; binds to whichever channel is current at call time."""

    def __init__(self, owner: ReloadingChannel, kind: str, method: str, args: tuple, kwargs: dict) -> None:
        self._owner, self._kind, self._method, self._args, self._kwargs = owner, kind, method, args, kwargs
        self._gen = -1
        self._mc: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ch, gen = self._owner.current()
        if gen != self._gen:
            self._mc = getattr(ch, self._kind)(self._method, *self._args, **self._kwargs)
            self._gen = gen
        return self._mc(*args, **kwargs)


class ReloadingChannel(grpc.aio.Channel):
    """A ``grpc.aio`` channel that is rebuilt with fresh credentials when the TLS files change.

    Stubs made on it keep working across a rotation: each call goes to the channel current at
    that moment, and the replaced channel is closed after ``drain_s`` so calls in flight finish.
    """

    def __init__(self, target: str, cfg: TlsConfig, options: list[tuple[str, object]],
                 interceptors: list[Any] | None = None, drain_s: float = 30.0) -> None:
        self._target, self._options, self._interceptors = target, [*options, *name_options(cfg)], interceptors
        self._files = CertFiles(cfg)
        self._drain_s = drain_s
        self._gen = 0
        self._ch = self._build(self._files.material)
        self._closing: set[asyncio.Task] = set()

    def _build(self, m: Material) -> grpc.aio.Channel:
        return grpc.aio.secure_channel(self._target, channel_credentials(m), options=self._options,
                                       interceptors=self._interceptors)

    @property
    def generation(self) -> int:
        return self._gen

    def current(self) -> tuple[grpc.aio.Channel, int]:
        new = self._files.poll()
        if new is not None:
            old, self._ch = self._ch, self._build(new)
            self._gen += 1
            try:
                task = asyncio.get_running_loop().create_task(old.close(grace=self._drain_s))
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
            except RuntimeError:  # no loop (e.g. at interpreter exit): let gRPC reclaim it
                pass
        return self._ch, self._gen

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _MultiCallable(self, "unary_unary", method, args, kwargs)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _MultiCallable(self, "unary_stream", method, args, kwargs)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _MultiCallable(self, "stream_unary", method, args, kwargs)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _MultiCallable(self, "stream_stream", method, args, kwargs)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self.current()[0].get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self.current()[0].wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self.current()[0].channel_ready()

    async def close(self, grace: float | None = None) -> None:
        for t in list(self._closing):
            t.cancel()
        await self._ch.close(grace)

    async def __aenter__(self) -> ReloadingChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close(None)


def aio_secure_channel(target: str, cfg: TlsConfig, options: list[tuple[str, object]],
                       interceptors: list[Any] | None = None) -> grpc.aio.Channel:
    return ReloadingChannel(target, cfg, options, interceptors)


def peer_identity_pem(context: Any) -> bytes | None:
    """The peer's leaf certificate (PEM) of a server call, or None on a plaintext connection."""
    try:
        auth = context.auth_context()
    except Exception:  # noqa: BLE001 - a context without auth data is simply unauthenticated
        return None
    pems = auth.get("x509_pem_cert") if auth else None
    return pems[0] if pems else None

