"""A trusted gateway is an mTLS identity, not an API key.

Only a peer whose client certificate carries a SPIFFE id listed in ``--trusted-gateways`` may
name the tenant (``x-tenant``, the gRPC ``tenant`` field), and it needs no API key (it
authenticated its users itself). A real Envoy with the gateway identity in front of the
router's HTTPS front door names tenants; a client with a fleet certificate of another role, a
gateway certificate not listed, no certificate, or a key flagged ``trusted`` in the keys file
cannot: 0 cached tokens across tenants whatever it sends.
"""

from __future__ import annotations

import asyncio
import random
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest

from kvmesh.api_keys import digest, new_key, write_secret
from kvmesh.rpc.tls import secure_sync_channel
from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.router.v1 import router_pb2, router_pb2_grpc
from kvmesh_tools.stack.certs import CertAuthority, Issued, write_envoy_sds
from kvmesh_tools.stack.envoy import envoy_binary, render_config, start_envoy
from kvmesh_tools.testing.procs import ServiceProcess
from tests.fixtures.router import BLOCK, MODEL

pytestmark = [pytest.mark.envoy, pytest.mark.timeout(240)]
GATEWAY = "spiffe://kvmesh.local/gateway/envoy"


@dataclass
class Stack:
    ca: CertAuthority
    router: ServiceProcess
    http_port: int
    key_a: str
    key_b: str
    key_flagged: str
    ids: dict[str, Issued]

    @property
    def base(self) -> str:
        return f"https://localhost:{self.http_port}"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("gw")
    ca = CertAuthority(tmp / "ca")
    ids = {n: ca.issue(*n.split("/")) for n in ("admin/t", "worker/g1", "router/r1", "gateway/envoy",
                                                  "gateway/other", "client/someone")}
    worker = ServiceProcess.with_ports("decode", lambda port: [
        "--engine", "sim", "--endpoint-id", "g1", "--model", MODEL, "--host", "127.0.0.1", "--port", str(port),
        "--block-size", str(BLOCK), "--num-blocks", "4096", "--time-scale", "20", "--grace-s", "1",
        "--kv-events-endpoint", "", "--kv-events-replay-endpoint", "", *ids["worker/g1"].flags()],
        log_path=tmp / "g1.log", tls=ids["admin/t"].tls_config()).start(timeout_s=90)
    key_a, key_b, key_flagged = new_key(), new_key(), new_key()
    keys = tmp / "api-keys"
    keys.write_text(f"tenant-a {digest(key_a)}\ntenant-b {digest(key_b)}\nold-gw {digest(key_flagged)} trusted\n")
    secret = tmp / "salt-secret"
    write_secret(secret)
    router = ServiceProcess.with_ports("router", lambda rport, http: [
        "--host", "127.0.0.1", "--port", str(rport), "--http-port", str(http), "--model", MODEL,
        "--block-size", str(BLOCK), "--load-poll-s", "0.1", "--grace-s", "1", "--endpoints", f"g1={worker.grpc_address}",
        "--auth", "keys", "--api-keys-file", str(keys), "--salt-secret-file", str(secret),
        "--tokenizer-path", str(tiny_model_dir), "--http-tls", "on", "--trusted-gateways", GATEWAY,
        *ids["router/r1"].flags()],
        count=2, log_path=tmp / "router.log", tls=ids["admin/t"].tls_config()).start(timeout_s=90)
    try:
        yield Stack(ca, router, router.flag_port("--http-port"), key_a, key_b, key_flagged, ids)
    finally:
        router.stop(grace_s=1)
        worker.stop(grace_s=1)


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30000) for _ in range(1500)]


def _client(st: Stack, me: str | None) -> httpx.Client:
    ctx = ssl.create_default_context(cafile=str(st.ids["admin/t"].ca))
    if me is not None:
        ctx.load_cert_chain(str(st.ids[me].cert), str(st.ids[me].key))
    return httpx.Client(verify=ctx, timeout=30)


def _post(c: httpx.Client, url: str, tokens: list[int], key: str | None = None, tenant: str | None = None
          ) -> httpx.Response:
    headers = {**({"authorization": f"Bearer {key}"} if key else {}), **({"x-tenant": tenant} if tenant else {})}
    return c.post(url + "/v1/completions", headers=headers,
                  json={"model": MODEL, "prompt": tokens, "max_tokens": 2})


def _cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _warm(st: Stack, tokens: list[int]) -> None:
    with _client(st, None) as c:
        _cached(_post(c, st.base, tokens, st.key_a))
        assert _cached(_post(c, st.base, tokens, st.key_a)) > 1000


def test_only_the_gateway_identity_names_tenants_over_https(stack: Stack) -> None:
    # Hostile: every other way of claiming tenant a gets nothing of a's cache (a fresh prompt
    # each, so no attempt hits what an earlier one cached under its own tenant).
    for n, (me, key) in enumerate(((None, stack.key_b), ("client/someone", stack.key_b),
                                   ("gateway/other", stack.key_b), (None, stack.key_flagged),
                                   ("client/someone", stack.key_flagged))):
        tokens = _prompt(100 + n)
        _warm(stack, tokens)
        with _client(stack, me) as c:
            assert _cached(_post(c, stack.base, tokens, key, "tenant-a")) == 0, (me, key)
    tokens = _prompt(1)
    _warm(stack, tokens)
    # Without a key only the trusted gateway is served at all.
    for me in (None, "client/someone", "gateway/other"):
        with _client(stack, me) as c:
            r = _post(c, stack.base, tokens, None, "tenant-a")
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (me, r.text)
    with _client(stack, "gateway/envoy") as c:
        assert _cached(_post(c, stack.base, tokens, None, "tenant-a")) > 1000
        # A gateway naming no tenant and forwarding no key is refused; with a key, the key's tenant.
        assert _post(c, stack.base, tokens).status_code == 401
        assert _cached(_post(c, stack.base, tokens, stack.key_b)) == 0


def test_the_gateway_identity_over_grpc(stack: Stack) -> None:
    tokens = _prompt(2)
    _warm(stack, tokens)

    def generate(me: str, key: str | None) -> int:
        ch = secure_sync_channel(stack.router.grpc_address, stack.ids[me].tls_config())
        try:
            req = router_pb2.GenerateRequest(model=MODEL, tokens=common_pb2.TokenIds(ids=tokens), tenant="tenant-a",
                                             sampling=common_pb2.SamplingParams(max_tokens=2))
            md = (("authorization", f"Bearer {key}"),) if key else ()
            out = list(router_pb2_grpc.RouterStub(ch).Generate(req, timeout=30, metadata=md))
            return out[-1].final.usage.cached_tokens
        finally:
            ch.close()

    assert generate("client/someone", stack.key_b) == 0
    assert generate("gateway/other", stack.key_flagged) == 0
    with pytest.raises(grpc.RpcError) as err:
        generate("client/someone", None)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert generate("gateway/envoy", None) > 1000


async def test_a_real_envoy_with_the_gateway_identity_names_tenants(stack: Stack, tmp_path: Path) -> None:
    try:
        envoy_binary()
    except RuntimeError as exc:
        pytest.fail(str(exc))
    tokens = _prompt(3)
    await asyncio.to_thread(_warm, stack, tokens)
    started = []
    try:
        for ident in ("gateway/envoy", "gateway/other"):
            sds = write_envoy_sds(stack.ca.issue(*ident.split("/"), out=tmp_path / ident.replace("/", "-")))
            cfg = render_config(router_http_ports=[stack.http_port], routers_sds=sds)
            started.append(await asyncio.to_thread(start_envoy, cfg, tmp_path / f"e{len(started)}", f"e{len(started)}"))
        good, other = started
        async with httpx.AsyncClient(timeout=30) as c:
            body = {"model": MODEL, "prompt": tokens, "max_tokens": 2}
            r = None
            for _ in range(60):    # until Envoy's health check has seen the router
                r = await c.post(good.routers_base + "/v1/completions", json=body, headers={"x-tenant": "tenant-a"})
                if r.status_code != 503:
                    break
                await asyncio.sleep(0.25)
            assert r is not None and _cached(r) > 1000
            # An Envoy with a gateway certificate that is not listed: its x-tenant means nothing.
            for _ in range(60):
                r = await c.post(other.routers_base + "/v1/completions", json=body,
                                 headers={"x-tenant": "tenant-a", "authorization": f"Bearer {stack.key_b}"})
                if r.status_code != 503:
                    break
                await asyncio.sleep(0.25)
            assert _cached(r) == 0
    finally:
        for e in started:
            e.stop()
