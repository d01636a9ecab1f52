"""``kvmesh certs``: make a throwaway CA and per-service certificates for mutual TLS.

For a local or compose stack (compose's ``certs-init`` runs it); a real fleet gets the same
files from cert-manager (deploy/k8s, docs/security.md). Running it again keeps the CA and
re-issues the certificates, which is how to rotate them: services pick the new files up
without a restart.
"""

from __future__ import annotations

import argparse
import json

from kvmesh.rpc.tls import DEFAULT_TRUST_DOMAIN

DEFAULT_IDENTITIES = ("indexer/indexer", "store/offload-0", "router/router", "gateway/envoy", "admin/admin",
                      "worker/decode-0", "worker/decode-1", "worker/prefill-0")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("certs", help="make a throwaway CA and per-service mTLS certificates",
                       description=__doc__.split("\n\n")[1])
    p.add_argument("--out", default="out/certs", help="folder for ca.pem, ca.key and ROLE-ID.pem/.key "
                                                      "(default: out/certs; an existing CA there is reused)")
    p.add_argument("--identity", dest="identities", action="append", default=None, metavar="ROLE/ID",
                   help="one certificate per ROLE/ID, repeatable; ROLE is router, worker, store, indexer, "
                        f"gateway, admin or client (default: {', '.join(DEFAULT_IDENTITIES)})")
    p.add_argument("--dns-name", dest="dns_names", action="append", default=[], metavar="NAME",
                   help="extra DNS name in every certificate, repeatable (localhost is always there)")
    p.add_argument("--ip", dest="ips", action="append", default=[], help="extra IP address SAN, repeatable")
    p.add_argument("--days", type=float, default=7.0, help="certificate lifetime in days (default: 7)")
    p.add_argument("--trust-domain", default=DEFAULT_TRUST_DOMAIN,
                   help=f"SPIFFE trust domain (default: {DEFAULT_TRUST_DOMAIN})")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvmesh_tools.stack.certs import issue_all, write_envoy_sds

    try:
        issued = issue_all(args.out, args.identities or DEFAULT_IDENTITIES, dns_names=args.dns_names,
                           ips=args.ips, days=args.days, trust_domain=args.trust_domain)
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    report = {k: {"cert": str(v.cert), "key": str(v.key), "ca": str(v.ca)} for k, v in issued.items()}
    gateways = [v for k, v in issued.items() if k.startswith("gateway/")]
    if gateways:   # Envoy's identity, as file-based SDS (deploy/envoy/envoy.yaml reads it)
        report["envoy_sds"] = str(write_envoy_sds(gateways[0]))
    print(json.dumps(report, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m kvmesh_tools.cli.cmd_certs ...``: the same command without the rest of the
    CLI's imports (the slim service images run it as compose's certs-init)."""
    import sys

    parser = argparse.ArgumentParser(prog="python -m kvmesh_tools.cli.cmd_certs")
    register(parser.add_subparsers())
    return int(run(parser.parse_args(["certs", *(sys.argv[1:] if argv is None else argv)])))


if __name__ == "__main__":
    raise SystemExit(main())
