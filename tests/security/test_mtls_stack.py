"""The local stack (``kvmesh up``'s launcher) with mutual TLS on, as it starts by default.

Real child processes: indexer, offload store, a sim decode worker and the router, each with its
own certificate from a throwaway CA. A request passes end to end (router -> indexer, worker ->
indexer and store, router -> worker all over mTLS), and every service refuses a client without a
certificate of the fleet.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.rpc.tls import plaintext, sync_channel
from kvmesh_api.indexer.v1 import indexer_pb2, indexer_pb2_grpc
from kvmesh_api.router.v1 import router_pb2, router_pb2_grpc
from kvmesh_tools.stack.certs import CertAuthority
from kvmesh_tools.stack.launcher import LocalStack, StackConfig

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    logs: Path = tmp_path_factory.mktemp("mtls-stack")
    st = LocalStack(StackConfig(decode_workers=1, prefill_workers=0, redis="off", time_scale=20.0,
                                num_blocks=128, split=False, log_dir=str(logs)))
    assert st.cfg.tls == "on"   # the default
    st.start()
    try:
        yield st
    finally:
        st.stop()


def test_a_request_passes_end_to_end_over_mtls(stack: LocalStack) -> None:
    with sync_channel(stack.indexer_address, stack.client_tls()) as ch:
        eps = indexer_pb2_grpc.IndexerStub(ch).ListEndpoints(indexer_pb2.ListEndpointsRequest(), timeout=10)
    assert {e.endpoint.endpoint_id for e in eps.endpoints} >= {"decode-0", "offload-0"}
    r = httpx.post(f"{stack.http_address}/v1/completions", timeout=60, headers=stack.auth_headers(),
                   json={"model": stack.cfg.model, "prompt": list(range(1, 300)), "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    with sync_channel(stack.router_address, stack.client_tls()) as ch:
        models = router_pb2_grpc.RouterStub(ch).ListModels(router_pb2.ListModelsRequest(), timeout=10,
                                                           metadata=(("x-api-key", stack.api_key),))
    assert stack.cfg.model in [m.id for m in models.models]


def test_every_service_refuses_a_client_without_a_fleet_certificate(stack: LocalStack, tmp_path: Path) -> None:
    stranger = CertAuthority(tmp_path / "ca").issue("admin", "stack", out=tmp_path / "stranger").tls_config()
    services = {"router": stack.router_address, "indexer": stack.indexer_address,
                "offload": stack.offload_address, **stack.decode_addresses}
    for name, address in services.items():
        for cfg in (plaintext(), stranger):
            with sync_channel(address, cfg) as ch:
                with pytest.raises(grpc.RpcError) as err:
                    health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, (name, cfg.tls)
        with sync_channel(address, stack.client_tls()) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING, name


def _served_serial(address: str, stack: LocalStack) -> int:
    """Serial number of the certificate ``address`` serves now (a fresh TLS handshake)."""
    import socket
    import ssl

    from cryptography import x509

    host, port = address.rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=str(stack.admin.ca))
    ctx.load_cert_chain(str(stack.admin.cert), str(stack.admin.key))
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname=host) as tls_sock:
        der = tls_sock.getpeercert(binary_form=True)
    return x509.load_der_x509_certificate(der).serial_number


def test_a_service_picks_up_a_rotated_certificate_without_a_restart(stack: LocalStack) -> None:
    import time

    from cryptography import x509

    indexer = next(sp for sp in stack.procs if sp.name == "indexer")
    pid = indexer.proc.pid
    before = _served_serial(stack.indexer_address, stack)
    # `kvmesh certs` again: same CA, new key and certificate written over the served files.
    issued = stack.ca.issue("indexer", "indexer", ips=[stack.cfg.host])
    new = x509.load_pem_x509_certificate(issued.cert.read_bytes()).serial_number
    assert new != before
    deadline = time.monotonic() + 15
    while _served_serial(stack.indexer_address, stack) != new:
        assert time.monotonic() < deadline, "the indexer still serves the old certificate"
        time.sleep(0.3)
    assert indexer.proc.pid == pid and indexer.alive()
    with sync_channel(stack.indexer_address, stack.client_tls()) as ch:
        eps = indexer_pb2_grpc.IndexerStub(ch).ListEndpoints(indexer_pb2.ListEndpointsRequest(), timeout=10)
    assert "decode-0" in {e.endpoint.endpoint_id for e in eps.endpoints}
