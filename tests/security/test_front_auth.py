"""Attack 4 (no authentication anywhere), router front door: a real router with ``--auth keys``.

Every OpenAI (completions, chat, Responses) and Anthropic endpoint and both gRPC methods refuse a caller without a valid
key - 401 in the endpoint's own error shape, ``UNAUTHENTICATED`` - before the body is read,
and serve the official clients that present one. A key added to or removed from the keys
file takes effect without a restart.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import anthropic
import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.api_keys import new_key
from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.router.v1 import router_pb2
from tests.fixtures.router import MODEL, start_router
from tests.fixtures.security import bearer

pytestmark = pytest.mark.timeout(180)

OPENAI_POSTS = {"/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
                "/v1/chat/completions": {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
                "/v1/responses": {"model": MODEL, "max_output_tokens": 2, "input": "hi"}}
ANTHROPIC_POSTS = {"/v1/messages": {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
                   "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}}
NO_KEY = [{}, {"authorization": "Bearer kvm-not-a-key"}, {"x-api-key": "kvm-not-a-key"},
          {"authorization": "Basic dXNlcjpwYXNz"}, {"x-tenant": "tenant-a"}]


@pytest.mark.parametrize("headers", NO_KEY, ids=["none", "bad-bearer", "bad-x-api-key", "basic", "tenant-only"])
def test_openai_endpoints_refuse_without_a_valid_key(secure_stack, headers):
    for path, body in OPENAI_POSTS.items():
        r = httpx.post(secure_stack.http_base + path, json=body, headers=headers, timeout=10)
        assert r.status_code == 401, (path, r.text)
        err = r.json()["error"]
        assert err["type"] == "authentication_error" and err["code"] == 401 and err["message"]
        assert "kvm-not-a-key" not in r.text      # the presented key is never echoed
    r = httpx.get(secure_stack.http_base + "/v1/models", headers=headers, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("headers", NO_KEY, ids=["none", "bad-bearer", "bad-x-api-key", "basic", "tenant-only"])
def test_anthropic_endpoints_refuse_in_anthropic_shape(secure_stack, headers):
    for path, body in ANTHROPIC_POSTS.items():
        r = httpx.post(secure_stack.http_base + path, json=body, headers=headers, timeout=10)
        assert r.status_code == 401, (path, r.text)
        doc = r.json()
        assert doc["type"] == "error" and doc["error"]["type"] == "authentication_error"


def test_health_stays_public(secure_stack):
    assert httpx.get(secure_stack.http_base + "/health", timeout=10).status_code == 200
    with grpc.insecure_channel(secure_stack.router.grpc_address) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_refused_before_the_body_is_read(secure_stack):
    """Headers announcing 100 MB, no body sent: the 401 comes back at once and the connection closes."""
    port = secure_stack.http_port
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 100000000\r\n\r\n{")
        t0 = time.monotonic()
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        assert time.monotonic() - t0 < 5
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 401") and b"connection: close" in head.lower()
    assert b"authentication_error" in body


def _gen(tokens: list[int]) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(model=MODEL, tokens=common_pb2.TokenIds(ids=tokens),
                                      sampling=common_pb2.SamplingParams(max_tokens=2))


@pytest.mark.parametrize("md", [(), (("authorization", "Bearer kvm-not-a-key"),), (("x-api-key", "nope"),),
                                (("x-tenant", "tenant-a"),)], ids=["none", "bad-bearer", "bad-x-api-key", "tenant"])
def test_grpc_refuses_unauthenticated(secure_stack, md):
    stub = secure_stack.stub()
    with pytest.raises(grpc.RpcError) as exc:
        list(stub.Generate(_gen([1, 2, 3]), timeout=10, metadata=md))
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as exc:
        stub.ListModels(router_pb2.ListModelsRequest(), timeout=10, metadata=md)
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_grpc_refuses_before_parsing_the_request(secure_stack):
    """A message that is not a GenerateRequest at all: no key -> UNAUTHENTICATED, not a parse error."""
    with grpc.insecure_channel(secure_stack.router.grpc_address) as ch:
        call = ch.unary_stream("/kvmesh.router.v1.Router/Generate", request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as exc:
            list(call(b"\xff\xff\xff garbage", timeout=10))
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("how", ["authorization", "x-api-key"])
def test_grpc_serves_a_valid_key(secure_stack, how):
    key = secure_stack.key_a
    md = (("authorization", f"Bearer {key}"),) if how == "authorization" else (("x-api-key", key),)
    stub = secure_stack.stub()
    assert stub.ListModels(router_pb2.ListModelsRequest(), timeout=10, metadata=md).models[0].id == MODEL
    msgs = list(stub.Generate(_gen(list(range(1, 50))), timeout=30, metadata=md))
    assert msgs[-1].HasField("final") and msgs[-1].final.usage.completion_tokens == 2


def test_official_openai_client_with_a_key(secure_stack):
    client = openai.OpenAI(base_url=secure_stack.http_base + "/v1", api_key=secure_stack.key_a, max_retries=0,
                           timeout=30)
    assert [m.id for m in client.models.list().data] == [MODEL]
    chat = client.chat.completions.create(model=MODEL, max_tokens=3,
                                          messages=[{"role": "user", "content": "Say hello."}])
    assert chat.usage.completion_tokens == 3
    chunks = list(client.completions.create(model=MODEL, prompt="def main():", max_tokens=3, stream=True))
    assert chunks
    assert client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=3).usage.output_tokens == 3
    bad = openai.OpenAI(base_url=secure_stack.http_base + "/v1", api_key="kvm-wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "x"}])


def test_official_anthropic_client_with_a_key(secure_stack):
    client = anthropic.Anthropic(base_url=secure_stack.http_base, api_key=secure_stack.key_b, max_retries=0,
                                 timeout=30)
    msg = client.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Say hello."}])
    assert msg.usage.output_tokens == 3 and msg.role == "assistant"
    with client.messages.stream(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Hi."}]) as s:
        final = s.get_final_message()
    assert final.usage.output_tokens == 3
    bad = anthropic.Anthropic(base_url=secure_stack.http_base, api_key="kvm-wrong", max_retries=0, timeout=30)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "x"}])


def test_keys_rotate_without_a_restart(secure_stack):
    """Add a key, use it, remove it: refused again, with the router still the same process."""
    pid = secure_stack.pid
    fresh = new_key()
    original = secure_stack.keys_file.read_text()
    url = secure_stack.http_base + "/v1/models"

    def status() -> int:
        return httpx.get(url, headers=bearer(fresh), timeout=10).status_code

    def wait(code: int) -> bool:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and status() != code:
            time.sleep(0.1)
        return status() == code

    assert status() == 401
    try:
        secure_stack.keys_file.write_text(original + f"tenant-c {fresh}\n")
        assert wait(200)
    finally:
        secure_stack.keys_file.write_text(original)
    assert wait(401)
    assert secure_stack.pid == pid and secure_stack.router.alive()
    assert httpx.get(url, headers=bearer(secure_stack.key_a), timeout=10).status_code == 200


def test_auth_off_is_logged_loudly_and_keys_without_a_file_refuse_to_start(tmp_path):
    router, http = start_router(tmp_path, [])          # the fixture's default: --auth off
    try:
        httpx.get(f"http://127.0.0.1:{http}/v1/models", timeout=10)
        log = router.log_path.read_text()
        assert log.count("AUTH IS OFF") >= 2, log[-2000:]    # at start, and on the first request
    finally:
        router.stop(grace_s=3)
    r = subprocess.run([sys.executable, "-m", "kvmesh_tools.cli.main", "serve", "router", "--auth", "keys",
                        "--port", "0", "--http-port", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "api_keys_file" in (r.stdout + r.stderr)
