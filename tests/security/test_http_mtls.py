"""The HTTP ports under zero trust: a worker's OpenAI API over HTTPS with client-certificate
roles, and /metrics behind a bearer token or a client certificate; /health stays open.

Before, a worker's HTTP API and every /metrics page were plaintext and open: anyone on the
network could send prompts straight to a worker (bypassing the router's keys and tenants) or
read the fleet's metrics.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx
import pytest

from kvmesh.metrics_http import MetricsAuthConfig, serve_metrics
from kvmesh.rpc.tls import TlsConfig
from kvmesh.worker.config import WorkerConfig
from kvmesh.worker.run import start_worker
from kvmesh_tools.stack.certs import CertAuthority, Issued

BODY = {"model": "sim-model", "prompt": [1, 2, 3, 4], "max_tokens": 2}


def client(ca: Issued | Path, me: Issued | None = None) -> httpx.AsyncClient:
    ctx = ssl.create_default_context(cafile=str(ca.ca if isinstance(ca, Issued) else ca))
    if me is not None:
        ctx.load_cert_chain(str(me.cert), str(me.key))
    return httpx.AsyncClient(verify=ctx, timeout=10)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Issued]:
    ca = CertAuthority(tmp_path_factory.mktemp("pki"))
    out = {n: ca.issue(*n.split("/")) for n in ("worker/w-https", "gateway/envoy", "router/r1", "admin/ops",
                                                  "client/someone", "monitor/prometheus", "worker/other")}
    other = CertAuthority(tmp_path_factory.mktemp("pki-other"))
    out["foreign/gateway"] = other.issue("gateway", "evil")
    return out


async def test_worker_http_api_needs_a_client_certificate_with_a_role(pki) -> None:  # noqa: ANN001
    w = await start_worker(WorkerConfig(
        engine="sim", role="decode", model="sim-model", endpoint_id="w-https", block_size=16, num_blocks=64,
        host="127.0.0.1", time_scale=50.0, max_model_len=4096, vocab_size=1000, kv_events_endpoint="",
        http_port=0, tls=pki["worker/w-https"].tls_config()))
    try:
        base = f"https://localhost:{w.http.port}"
        me = pki["worker/w-https"]
        # /health: open to a probe without a certificate (kubelet's httpGet with scheme HTTPS).
        async with client(me) as c:
            assert (await c.get(base + "/health")).status_code == 200
            r = await c.post(base + "/v1/completions", json=BODY)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert (await c.get(base + "/metrics")).status_code == 401
        for who, code in (("client/someone", 403), ("worker/other", 403), ("gateway/envoy", 200),
                          ("router/r1", 200), ("admin/ops", 200)):
            async with client(me, pki[who]) as c:
                r = await c.post(base + "/v1/completions", json=BODY)
                assert r.status_code == code, (who, r.text)
                if code == 403:
                    assert r.json()["error"]["type"] == "permission_error"
        # A monitor reads the worker's /metrics on this port, but may not generate.
        async with client(me, pki["monitor/prometheus"]) as c:
            assert (await c.get(base + "/metrics")).status_code == 200
            assert (await c.post(base + "/v1/completions", json=BODY)).status_code == 403
        # A certificate from another CA does not even complete the handshake; nor does plaintext.
        async with client(me, pki["foreign/gateway"]) as c:
            with pytest.raises((httpx.HTTPError, ssl.SSLError)):
                await c.post(base + "/v1/completions", json=BODY)
        async with httpx.AsyncClient(timeout=5) as c:
            with pytest.raises((httpx.HTTPError, ssl.SSLError)):
                await c.post(f"http://127.0.0.1:{w.http.port}/v1/completions", json=BODY)
        assert w.http.guard.refused >= 5
        # Still serving after all that.
        async with client(me, pki["gateway/envoy"]) as c:
            assert (await c.post(base + "/v1/completions", json=BODY)).status_code == 200
    finally:
        await w.stop(0)


def _metrics(pki: dict[str, Issued], tmp: Path, **auth: str) -> tuple[int, TlsConfig]:
    tls = pki["worker/w-https"].tls_config()
    return serve_metrics(0, "127.0.0.1", auth=MetricsAuthConfig(**auth), tls=tls), tls


async def test_metrics_behind_a_bearer_token_rotated_on_disk(pki, tmp_path: Path) -> None:  # noqa: ANN001
    token = tmp_path / "token"
    token.write_text("s3cret-one\n")
    port, _ = _metrics(pki, tmp_path, metrics_token_file=str(token))
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(timeout=10) as c:
        assert (await c.get(url + "/health")).status_code == 200
        r = await c.get(url + "/metrics")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert (await c.get(url + "/metrics", headers={"authorization": "Bearer wrong"})).status_code == 401
        assert (await c.get(url + "/metrics", headers={"authorization": "Basic s3cret-one"})).status_code == 401
        ok = await c.get(url + "/metrics", headers={"authorization": "Bearer s3cret-one"})
        assert ok.status_code == 200 and "python_info" in ok.text
        # Rotation: the new token works, the old one no longer does, no restart.
        new = tmp_path / "token.new"
        new.write_text("s3cret-two")
        new.replace(token)
        assert (await c.get(url + "/metrics", headers={"authorization": "Bearer s3cret-two"})).status_code == 200
        assert (await c.get(url + "/metrics", headers={"authorization": "Bearer s3cret-one"})).status_code == 401


async def test_metrics_over_https_for_monitor_certificates(pki, tmp_path: Path) -> None:  # noqa: ANN001
    port, _ = _metrics(pki, tmp_path, metrics_tls="on")
    url = f"https://localhost:{port}"
    me = pki["worker/w-https"]
    async with client(me) as c:
        assert (await c.get(url + "/health")).status_code == 200
        assert (await c.get(url + "/metrics")).status_code == 401
    async with client(me, pki["client/someone"]) as c:
        r = await c.get(url + "/metrics")
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    for who in ("monitor/prometheus", "admin/ops"):
        async with client(me, pki[who]) as c:
            assert (await c.get(url + "/metrics")).status_code == 200
    async with client(me, pki["foreign/gateway"]) as c:
        with pytest.raises((httpx.HTTPError, ssl.SSLError)):
            await c.get(url + "/metrics")
    async with httpx.AsyncClient(timeout=5) as c:   # plaintext to the HTTPS port: refused, port still fine
        with pytest.raises((httpx.HTTPError, ssl.SSLError)):
            await c.get(f"http://127.0.0.1:{port}/metrics")
    async with client(me, pki["monitor/prometheus"]) as c:
        assert (await c.get(url + "/metrics")).status_code == 200
