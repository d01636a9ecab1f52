"""``kvmesh certs``: a CA and one certificate per ROLE/ID, carrying that SPIFFE identity."""

from __future__ import annotations

import json
from pathlib import Path

from kvmesh.rpc.authz import Identity, identity_from_pem
from kvmesh.rpc.tls import key_matches
from kvmesh_tools.cli.main import main


def test_certs_issues_identities_and_reuses_its_ca(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    out = tmp_path / "certs"
    assert main(["certs", "--out", str(out), "--identity", "worker/decode-0", "--identity", "admin/ops",
                 "--dns-name", "kvmesh-indexer", "--trust-domain", "t.example"]) == 0
    files = json.loads(capsys.readouterr().out)
    cert = Path(files["worker/decode-0"]["cert"]).read_bytes()
    assert identity_from_pem(cert) == Identity("t.example", "worker", "decode-0")
    assert key_matches(cert, Path(files["worker/decode-0"]["key"]).read_bytes())
    from cryptography import x509

    san = x509.load_pem_x509_certificate(cert).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert "kvmesh-indexer" in san.value.get_values_for_type(x509.DNSName)
    ca = (out / "ca.pem").read_bytes()
    # Again (a rotation): same CA, new certificates.
    assert main(["certs", "--out", str(out), "--identity", "worker/decode-0"]) == 0
    capsys.readouterr()
    assert (out / "ca.pem").read_bytes() == ca
    assert Path(files["worker/decode-0"]["cert"]).read_bytes() != cert
    assert main(["certs", "--out", str(out), "--identity", "hacker/x"]) == 2


def test_a_gateway_identity_comes_with_envoy_sds_files(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    import yaml

    from kvmesh_tools.cli.cmd_certs import main as certs_main

    assert certs_main(["--out", str(tmp_path), "--identity", "gateway/envoy"]) == 0
    report = json.loads(capsys.readouterr().out)
    cert_doc = yaml.safe_load((Path(report["envoy_sds"]) / "envoy-sds-cert.yaml").read_text())
    (secret,) = cert_doc["resources"]
    assert secret["tls_certificate"]["certificate_chain"]["filename"] == str((tmp_path / "gateway-envoy.pem").resolve())
    ca_doc = yaml.safe_load((Path(report["envoy_sds"]) / "envoy-sds-ca.yaml").read_text())
    assert ca_doc["resources"][0]["validation_context"]["trusted_ca"]["filename"].endswith("ca.pem")
