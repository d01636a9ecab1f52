"""A throwaway CA and per-service certificates for mutual TLS on a local or compose stack.

Why it exists: ``kvmesh up``, ``make demo``, compose's certs-init step and the tests need the
same thing a real fleet gets from cert-manager: one CA, and for each service a key and a
certificate whose SPIFFE URI SAN (``spiffe://<trust-domain>/<role>/<id>``) is its identity for
``kvmesh.rpc.authz``. Certificates serve both ends of a connection (server and client auth),
name ``localhost``/``127.0.0.1`` and the given DNS names, and are short-lived. Files are written
atomically (temp file + rename), key before certificate, so a service reloading its files never
reads half a rotation.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvmesh.rpc.authz import ROLES, spiffe_uri
from kvmesh.rpc.tls import DEFAULT_TRUST_DOMAIN, TlsConfig

CA_CERT = "ca.pem"
CA_KEY = "ca.key"


@dataclass(frozen=True)
class Issued:
    """The three files one service needs (``--tls-cert/--tls-key/--tls-ca``)."""

    cert: Path
    key: Path
    ca: Path

    def tls_config(self, **kw: object) -> TlsConfig:
        return TlsConfig(tls="on", tls_cert=str(self.cert), tls_key=str(self.key), tls_ca=str(self.ca), **kw)

    def flags(self) -> list[str]:
        return ["--tls", "on", "--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca", str(self.ca)]


def _write(path: Path, data: bytes, mode: int = 0o644) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class CertAuthority:
    """A CA kept as ``ca.pem``/``ca.key`` in ``out``; loaded if present, else created."""

    def __init__(self, out: str | Path, name: str = "kvmesh throwaway CA", days: float = 30.0,
                 trust_domain: str = DEFAULT_TRUST_DOMAIN) -> None:
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.trust_domain = trust_domain
        self.ca_path = self.out / CA_CERT
        key_path = self.out / CA_KEY
        if self.ca_path.exists() and key_path.exists():
            self.cert = x509.load_pem_x509_certificate(self.ca_path.read_bytes())
            self.key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
            return
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.cert = (
            x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(_now() - dt.timedelta(minutes=5)).not_valid_after(_now() + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(self.key, hashes.SHA256()))
        _write(key_path, _key_pem(self.key), 0o600)
        _write(self.ca_path, self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, role: str, ident: str, *, dns_names: Iterable[str] = (), ips: Iterable[str] = (),
              days: float = 7.0, out: str | Path | None = None, name: str | None = None,
              not_after: dt.datetime | None = None) -> Issued:
        """Key + certificate for ``spiffe://<domain>/<role>/<ident>``, written as ``<name>.pem/.key``."""
        if role not in ROLES:
            raise ValueError(f"role {role!r} is not one of {ROLES}")
        folder = Path(out) if out is not None else self.out
        folder.mkdir(parents=True, exist_ok=True)
        name = name or f"{role}-{ident}"
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(spiffe_uri(self.trust_domain, role, ident))]
        sans += [x509.DNSName(d) for d in dict.fromkeys(["localhost", *dns_names])]
        sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in dict.fromkeys(["127.0.0.1", "::1", *ips])]
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{role}/{ident}")]))
            .issuer_name(self.cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(_now() - dt.timedelta(minutes=5))
            .not_valid_after(not_after or _now() + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(self.key, hashes.SHA256()))
        issued = Issued(folder / f"{name}.pem", folder / f"{name}.key", folder / CA_CERT)
        # Key first: a reader that sees the new certificate also sees its key (tls.CertFiles
        # re-checks the pair anyway).
        _write(issued.key, _key_pem(key), 0o600)
        _write(issued.cert, cert.public_bytes(serialization.Encoding.PEM))
        if issued.ca != self.ca_path:
            _write(issued.ca, self.ca_path.read_bytes())
        return issued


def parse_identity(spec: str) -> tuple[str, str]:
    """``ROLE/ID`` (e.g. ``worker/decode-0``)."""
    role, _, ident = spec.partition("/")
    if role not in ROLES or not ident or "/" in ident:
        raise ValueError(f"identity {spec!r}: expected ROLE/ID with ROLE one of {', '.join(ROLES)}")
    return role, ident


def issue_all(out: str | Path, identities: Iterable[str], *, dns_names: Iterable[str] = (),
              ips: Iterable[str] = (), days: float = 7.0, trust_domain: str = DEFAULT_TRUST_DOMAIN
              ) -> dict[str, Issued]:
    """A CA in ``out`` (reused if there) and one certificate per ``ROLE/ID``, keyed by ``ROLE/ID``."""
    ca = CertAuthority(out, trust_domain=trust_domain)
    res = {}
    for spec in identities:
        role, ident = parse_identity(spec)
        res[spec] = ca.issue(role, ident, dns_names=dns_names, ips=ips, days=days)
    return res


ENVOY_SDS_CERT = "envoy-sds-cert.yaml"
ENVOY_SDS_CA = "envoy-sds-ca.yaml"
ENVOY_CERT_SECRET = "kvmesh-gateway-cert"
ENVOY_CA_SECRET = "kvmesh-ca"


def write_envoy_sds(issued: Issued, folder: str | Path | None = None) -> Path:
    """Envoy's file-based SDS resources for ``issued``: ``envoy-sds-cert.yaml`` (its client
    certificate) and ``envoy-sds-ca.yaml`` (the CA), one secret per file as Envoy requires.

    Envoy's ``kvmesh-epp`` cluster (deploy/envoy/envoy.yaml) reads its identity from these files
    rather than from inline file names, so a rotation is picked up without a restart: Envoy
    watches the SDS files and the certificate folder. Returns the folder that holds them.
    """
    import yaml

    out = Path(folder) if folder is not None else issued.cert.parent
    secret = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
    watched = {"path": str(issued.cert.resolve().parent)}
    docs = {
        ENVOY_SDS_CERT: {"@type": secret, "name": ENVOY_CERT_SECRET, "tls_certificate": {
            "certificate_chain": {"filename": str(issued.cert.resolve())},
            "private_key": {"filename": str(issued.key.resolve())}, "watched_directory": watched}},
        ENVOY_SDS_CA: {"@type": secret, "name": ENVOY_CA_SECRET, "validation_context": {
            "trusted_ca": {"filename": str(issued.ca.resolve())}, "watched_directory": watched}},
    }
    for name, res in docs.items():
        _write(out / name, yaml.safe_dump({"resources": [res]}, sort_keys=False).encode())
    return out
