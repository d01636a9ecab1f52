"""Mutual TLS on kvmesh's gRPC servers and channels: who gets in, and rotation without restart.

Real ``grpc.aio`` servers on loopback with certificates from a throwaway CA (``cryptography``).
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.config import ConfigError, load_config
from kvmesh.rpc import tls
from kvmesh.rpc.authz import Identity, identity_from_pem
from kvmesh.rpc.channel import aio_channel
from kvmesh.rpc.healthcheck import check
from kvmesh.rpc.server import ServerOptions, ServiceServer
from kvmesh_tools.stack.certs import CertAuthority, Issued

pytestmark = pytest.mark.timeout(60)

FAST = {"tls_reload_s": 0.05}


async def start(issued: Issued, **kw: object) -> ServiceServer:
    server = ServiceServer("t", [], ServerOptions(host="127.0.0.1", port=0, tls=issued.tls_config(**FAST, **kw)))
    await server.start()
    await server.set_ready(True)
    return server


async def health(ch: grpc.aio.Channel) -> int:
    resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
    return resp.status


def copy_identity(src: Issued, dst: Issued) -> None:
    """Rotate ``dst``'s files in place to ``src``'s (key first, as cert-manager's writers do)."""
    for a, b in ((src.key, dst.key), (src.cert, dst.cert), (src.ca, dst.ca)):
        tmp = Path(str(b) + ".new")
        shutil.copyfile(a, tmp)
        tmp.replace(b)


def test_certificate_carries_spiffe_identity(certs) -> None:  # noqa: ANN001
    issued = certs("worker", "decode-0")
    assert identity_from_pem(issued.cert.read_bytes()) == Identity("kvmesh.local", "worker", "decode-0")
    assert tls.key_matches(issued.cert.read_bytes(), issued.key.read_bytes())
    other = certs("router", "r")
    assert not tls.key_matches(issued.cert.read_bytes(), other.key.read_bytes())


def test_config_flags_and_validation(certs) -> None:  # noqa: ANN001
    assert not tls.TlsConfig().enabled()   # auto without files: plaintext
    issued = certs("router", "r")
    env = {"KVMESH_X_TLS_CERT": str(issued.cert), "KVMESH_X_TLS_KEY": str(issued.key),
           "KVMESH_X_TLS_CA": str(issued.ca)}
    assert load_config(tls.TlsConfig, env_prefix="KVMESH_X_", env=env).enabled()
    assert not load_config(tls.TlsConfig, env_prefix="KVMESH_X_", env={**env, "KVMESH_X_TLS": "off"}).enabled()
    with pytest.raises(ConfigError, match="--tls on needs"):
        load_config(tls.TlsConfig, env_prefix="KVMESH_X_", env={"KVMESH_X_TLS": "on"})
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tls.TlsConfig, env_prefix="KVMESH_X_", env={**env, "KVMESH_X_TLS_CA": "/nonexistent"})


async def test_only_clients_with_a_certificate_from_the_ca_get_in(certs, tmp_path: Path) -> None:  # noqa: ANN001
    server = await start(certs("indexer", "indexer"))
    target = f"127.0.0.1:{server.port}"
    try:
        async with aio_channel(target, tls=certs("router", "r").tls_config()) as ch:
            assert await health(ch) == health_pb2.HealthCheckResponse.SERVING
        stranger = CertAuthority(tmp_path / "other-ca").issue("router", "r", out=tmp_path / "stranger")
        bad = [tls.plaintext(), stranger.tls_config()]
        for cfg in bad:
            async with aio_channel(target, tls=cfg) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await health(ch)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # TLS that trusts the server but presents no client certificate.
        own = certs("router", "r2")
        creds = grpc.ssl_channel_credentials(root_certificates=own.ca.read_bytes())
        async with grpc.aio.secure_channel(target, creds) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await health(ch)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # The command-line probe, with and without an identity.
        assert (await asyncio.to_thread(check, target, "", 3.0, own.tls_config()))[0] == 0
        assert (await asyncio.to_thread(check, target, "", 2.0))[0] == 2
    finally:
        await server.stop(0)


async def test_server_picks_up_rotated_files_without_restart(certs, tmp_path: Path) -> None:  # noqa: ANN001
    served = certs("indexer", "indexer")
    server = await start(served)
    target = f"127.0.0.1:{server.port}"
    new_ca = CertAuthority(tmp_path / "ca2")
    new_client = new_ca.issue("router", "r", out=tmp_path / "client2")
    old_client = certs("router", "r")
    try:
        async with aio_channel(target, tls=new_client.tls_config()) as ch:
            with pytest.raises(grpc.aio.AioRpcError):
                await health(ch)
        copy_identity(new_ca.issue("indexer", "indexer", out=tmp_path / "server2"), served)
        await asyncio.sleep(0.2)
        async with aio_channel(target, tls=new_client.tls_config()) as ch:
            assert await health(ch) == health_pb2.HealthCheckResponse.SERVING
        async with aio_channel(target, tls=old_client.tls_config()) as ch:
            with pytest.raises(grpc.aio.AioRpcError):
                await health(ch)
        assert server.tls_files is not None and server.tls_files.reloads == 1
    finally:
        await server.stop(0)


async def test_client_channel_rebuilds_when_its_files_rotate(certs, tmp_path: Path) -> None:  # noqa: ANN001
    new_ca = CertAuthority(tmp_path / "ca2")
    server = await start(new_ca.issue("indexer", "indexer", out=tmp_path / "server2"))
    mine = certs("router", "r")
    try:
        ch = aio_channel(f"127.0.0.1:{server.port}", tls=mine.tls_config(**FAST))
        stub = health_pb2_grpc.HealthStub(ch)   # made once, kept across the rotation
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
        copy_identity(new_ca.issue("router", "r", out=tmp_path / "client2"), mine)
        await asyncio.sleep(0.2)
        resp = await stub.Check(health_pb2.HealthCheckRequest(), timeout=3)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        assert isinstance(ch, tls.ReloadingChannel) and ch.generation == 1
        await ch.close()
    finally:
        await server.stop(0)


async def test_half_written_rotation_is_not_served(certs) -> None:  # noqa: ANN001
    served = certs("indexer", "indexer")
    files = tls.CertFiles(served.tls_config(**FAST))
    before = files.material
    other = certs("indexer", "indexer2")
    shutil.copyfile(other.cert, served.cert)   # certificate written, its key not yet
    await asyncio.sleep(0.1)
    assert files.poll() is None and files.material == before
    shutil.copyfile(other.key, served.key)
    await asyncio.sleep(0.1)
    assert files.poll() is not None and files.material.cert == other.cert.read_bytes()


async def test_rotation_to_a_new_ca_waits_for_the_ca_file(certs, tmp_path: Path) -> None:  # noqa: ANN001
    """Files are replaced one at a time: new certificate and key with the old CA is a matching
    pair, but not a set to serve, since the old CA did not issue the new certificate."""
    served = certs("indexer", "indexer")
    files = tls.CertFiles(served.tls_config(**FAST))
    rotated = CertAuthority(tmp_path / "ca2").issue("indexer", "indexer", out=tmp_path / "server2")
    for a, b in ((rotated.key, served.key), (rotated.cert, served.cert)):
        shutil.copyfile(a, b)
    await asyncio.sleep(0.1)
    assert files.poll() is None and files.reloads == 0
    shutil.copyfile(rotated.ca, served.ca)
    await asyncio.sleep(0.1)
    assert files.poll() is not None and files.reloads == 1 and files.material.ca == rotated.ca.read_bytes()


def test_own_certificate_from_another_root_still_loads(certs, tmp_path: Path) -> None:  # noqa: ANN001
    """Deployments may trust peers from one root and hold a certificate from another; the
    same-CA check applies only when the first set had that property."""
    own = CertAuthority(tmp_path / "own-ca").issue("indexer", "indexer", out=tmp_path / "own")
    peers = certs("router", "r")
    files = tls.CertFiles(tls.from_files(str(own.cert), str(own.key), str(peers.ca)))
    assert files.material.ca == peers.ca.read_bytes()
    assert not tls.issued_by_bundle(own.cert.read_bytes(), peers.ca.read_bytes())
    assert tls.issued_by_bundle(own.cert.read_bytes(), own.ca.read_bytes())


async def test_plaintext_health_port_serves_only_health(certs) -> None:  # noqa: ANN001
    from kvmesh_tools.testing.ports import free_port

    for attempt in range(5):
        port = free_port()
        try:
            server = await start(certs("indexer", "indexer"), tls_health_port=port)
            break
        except RuntimeError:
            if attempt == 4:
                raise
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            assert await health(ch) == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await ch.unary_unary("/kvmesh.indexer.v1.Indexer/Stats")(b"", timeout=2)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await server.stop(0)


def test_process_identity_comes_from_env_and_is_exported_to_children(certs, monkeypatch) -> None:  # noqa: ANN001
    """A worker hands its identity to the processes it starts (vLLM's engine core runs the
    offload connector) through KVMESH_TLS_*; a process that never set one reads them."""
    import os

    issued = certs("worker", "decode-0")
    keys = ("KVMESH_TLS", "KVMESH_TLS_CERT", "KVMESH_TLS_KEY", "KVMESH_TLS_CA", "KVMESH_TLS_SERVER_NAME",
            "KVMESH_TLS_TRUST_DOMAIN")
    saved = {k: os.environ.pop(k, None) for k in keys}
    monkeypatch.setattr(tls, "_default", None)
    try:
        assert not tls.default().enabled()
        tls.set_default(issued.tls_config(tls_server_name="kvmesh"), export=True)
        tls._default = None   # as in a fresh child process with that env
        child = tls.default()
        assert child.enabled() and child.tls_cert == str(issued.cert) and child.tls_server_name == "kvmesh"
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v
