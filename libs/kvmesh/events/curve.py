"""Optional CURVE authentication and encryption of KV-event sockets (pyzmq).

Why: a KV-event stream carries every cached prompt's token ids, and the replay
socket hands out everything buffered to whoever asks. On a shared network the
defaults (loopback binds, network policies) are the first line; CURVE is the
second: the publisher's PUB and replay ROUTER become CURVE servers that admit
only clients whose public keys sit in an allow-list directory (a ZAP handler on
the publisher's context), and the indexer connects with its own key pair and
the endpoint's server public key. Keys are ZMQ certificate files
(``zmq.auth.create_certificates``): ``NAME.key`` (public) and
``NAME.key_secret``. Off by default.

vLLM's own publisher has no CURVE support, so only kvmesh's publishers (the
simulated engine, the offload store) can turn it on; for vLLM engines the
protection is the loopback default and the network policies.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator


class CurveError(ValueError):
    """A key file is missing or unreadable."""


@dataclass(frozen=True)
class CurveServer:
    """A publisher's side: its secret certificate and the directory of admitted client public keys."""

    secret_file: str
    clients_dir: str


@dataclass(frozen=True)
class CurveClient:
    """A subscriber's side: its secret certificate and the publisher's public certificate."""

    secret_file: str
    server_public_file: str


def generate(directory: str | Path, name: str) -> tuple[Path, Path]:
    """A new key pair ``directory/NAME.key`` and ``NAME.key_secret`` (the secret file is 0600)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(d), name)
    Path(secret).chmod(0o600)
    return Path(public), Path(secret)


def _load(path: str, *, secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, sec = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveError(f"cannot read CURVE certificate {path!r}: {exc}") from None
    if secret and sec is None:
        raise CurveError(f"CURVE certificate {path!r} has no secret key (want the NAME.key_secret file)")
    return public, sec


_auth_lock = threading.Lock()
_authenticators: dict[int, ThreadAuthenticator] = {}


def _authenticator(ctx: zmq.Context, clients_dir: str) -> None:
    """One ZAP handler per context, admitting the public keys found in ``clients_dir``."""
    if not Path(clients_dir).is_dir():
        raise CurveError(f"CURVE clients directory {clients_dir!r} does not exist")
    with _auth_lock:
        auth = _authenticators.get(id(ctx))
        if auth is None:
            auth = ThreadAuthenticator(ctx)
            auth.start()
            _authenticators[id(ctx)] = auth
        auth.configure_curve(domain="*", location=clients_dir)


def apply_server(sock: zmq.Socket, cfg: CurveServer) -> None:
    """Make ``sock`` a CURVE server admitting only ``cfg.clients_dir``'s keys (before bind)."""
    public, secret = _load(cfg.secret_file, secret=True)
    _authenticator(sock.context, cfg.clients_dir)
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_server = True


def apply_client(sock: zmq.Socket, cfg: CurveClient) -> None:
    """Make ``sock`` a CURVE client of the server whose public key is ``cfg.server_public_file``."""
    public, secret = _load(cfg.secret_file, secret=True)
    server_public, _ = _load(cfg.server_public_file, secret=False)
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_serverkey = server_public


def server_public_file(servers_dir: str, endpoint_id: str) -> str | None:
    """``servers_dir/<endpoint_id>.key`` when it exists (the indexer's per-endpoint key lookup)."""
    if not servers_dir:
        return None
    p = Path(servers_dir) / f"{endpoint_id}.key"
    return str(p) if p.is_file() else None
