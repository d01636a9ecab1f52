"""``python -m kvmesh.rpc.healthcheck HOST:PORT``: exit 0 iff the gRPC health check says SERVING.

Container health checks (Docker ``HEALTHCHECK``, compose ``healthcheck``) need a
command, and the images are slim: rather than shipping the separate
grpc_health_probe binary, the image reuses the grpcio it already has.
Kubernetes uses its native ``grpc`` probes instead and does not need this.

With mutual TLS on the service, give the probe its own identity: ``--tls-cert/--tls-key/--tls-ca``
(or env ``KVMESH_TLS_CERT`` etc.); or probe the service's plaintext ``--tls-health-port``.

Exit codes: 0 SERVING, 1 NOT_SERVING/UNKNOWN/SERVICE_UNKNOWN, 2 unreachable or
timeout, 64 bad usage.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.config import ConfigError, add_dataclass_args, load_config
from kvmesh.rpc.tls import TlsConfig, plaintext, sync_channel


def check(address: str, service: str = "", timeout_s: float = 3.0,
          tls: TlsConfig | None = None) -> tuple[int, str]:
    """Return ``(exit_code, status_text)`` for one health check (over mTLS when ``tls`` is on)."""
    try:
        with sync_channel(address, tls or plaintext()) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s,
                              wait_for_ready=False)
    except grpc.RpcError as exc:
        code = exc.code()
        if code == grpc.StatusCode.NOT_FOUND:
            return 1, f"service {service!r} unknown to {address}"
        return 2, f"{address}: {code.name if code else 'error'}: {exc.details()}"
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return (0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1), name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmesh.rpc.healthcheck",
                                description="gRPC health check; exit 0 when SERVING")
    p.add_argument("address", help="HOST:PORT of the gRPC server")
    p.add_argument("--service", default="", help="health service name ('' = overall readiness, "
                                                 "'liveness' = process alive)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    add_dataclass_args(p, TlsConfig, "KVMESH_")
    try:
        args = p.parse_args(argv)
        tls = load_config(TlsConfig, args, "KVMESH_")
    except SystemExit as exc:
        return 64 if exc.code else 0
    except ConfigError as exc:
        sys.stderr.write(f"{exc}\n")
        return 64
    if ":" not in args.address:
        sys.stderr.write(f"address must be HOST:PORT, got {args.address!r}\n")
        return 64
    code, text = check(args.address, args.service, args.timeout, tls)
    (sys.stdout if code == 0 else sys.stderr).write(text + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
