"""Attack 3 (tenant bypass): the tenant and its salt come from the API key only.

Tenant a warms the cache with a prompt; tenant b then sends the same prompt claiming to be
a every way a client can - the ``x-tenant`` header, the gRPC ``tenant`` field, the old
guessable salt ``tenant:tenant-a`` as ``cache_salt``, a's key id, both front doors - and
must get 0 cached tokens (and a 0 predicted hit) every time. Only a trusted gateway's mTLS
identity may name the tenant (test_gateway_identity.py); a key flagged ``trusted`` may not. A client ``cache_salt`` is mixed into the
tenant's salt: it separates a tenant's own requests, never joins another tenant's.
"""

from __future__ import annotations

import random

import httpx
import pytest

from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.router.v1 import router_pb2
from tests.fixtures.router import MODEL
from tests.fixtures.security import bearer

pytestmark = pytest.mark.timeout(180)


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30000) for _ in range(1500)]


def _http(stack, key: str, tokens: list[int], headers: dict[str, str] | None = None, **body) -> dict:
    r = httpx.post(stack.http_base + "/v1/completions", timeout=30, headers={**bearer(key), **(headers or {})},
                   json={"model": MODEL, "prompt": tokens, "max_tokens": 2, **body})
    assert r.status_code == 200, r.text
    doc = r.json()
    return {"cached": doc["usage"]["prompt_tokens_details"]["cached_tokens"],
            "predicted": doc["kvmesh"]["predicted_cached_tokens"]}


def _grpc(stack, key: str, tokens: list[int], metadata: tuple = (), **fields) -> dict:
    req = router_pb2.GenerateRequest(model=MODEL, tokens=common_pb2.TokenIds(ids=tokens),
                                     sampling=common_pb2.SamplingParams(max_tokens=2), **fields)
    final = list(stack.stub().Generate(req, timeout=30, metadata=(("authorization", f"Bearer {key}"),
                                                                       *metadata)))[-1].final
    return {"cached": final.usage.cached_tokens, "predicted": final.routing.predicted_cached_tokens}


def _warm(stack, tokens: list[int]) -> None:
    """Tenant a's prompt, twice: the second is a cache hit (the cache works at all)."""
    _http(stack, stack.key_a, tokens)
    assert _http(stack, stack.key_a, tokens)["cached"] > 1000


ATTEMPTS = {
    "plain": lambda st, t: _http(st, st.key_b, t),
    "x-tenant header": lambda st, t: _http(st, st.key_b, t, {"x-tenant": "tenant-a"}),
    "old guessable salt": lambda st, t: _http(st, st.key_b, t, cache_salt="tenant:tenant-a"),
    "x-tenant + salt": lambda st, t: _http(st, st.key_b, t, {"x-tenant": "tenant-a"}, cache_salt="tenant-a"),
    "x-api-key of a next to b's bearer": lambda st, t: _http(st, st.key_b, t, {"x-api-key": "tenant-a"}),
    "grpc plain": lambda st, t: _grpc(st, st.key_b, t),
    "grpc tenant field": lambda st, t: _grpc(st, st.key_b, t, tenant="tenant-a"),
    "grpc x-tenant metadata": lambda st, t: _grpc(st, st.key_b, t, (("x-tenant", "tenant-a"),)),
    "grpc tenant + salt": lambda st, t: _grpc(st, st.key_b, t, tenant="tenant-a", cache_salt="tenant:tenant-a"),
}


@pytest.mark.parametrize("attempt", list(ATTEMPTS))
def test_another_tenant_gets_no_cached_token_whatever_it_sends(secure_stack, attempt):
    tokens = _prompt(hash(attempt) % 100_000)
    _warm(secure_stack, tokens)
    got = ATTEMPTS[attempt](secure_stack, tokens)
    assert got == {"cached": 0, "predicted": 0}, got


def test_a_key_flagged_trusted_names_no_tenant(secure_stack):
    """Trust comes from a gateway's mTLS identity (tests/security/test_gateway_identity.py), never
    from a key: the keys file's old 'trusted' flag lets its holder name no tenant."""
    for n, send in enumerate((lambda t: _http(secure_stack, secure_stack.key_gateway, t, {"x-tenant": "tenant-a"}),
                              lambda t: _grpc(secure_stack, secure_stack.key_gateway, t, tenant="tenant-a"))):
        tokens = _prompt(4242 + n)
        _warm(secure_stack, tokens)
        assert send(tokens) == {"cached": 0, "predicted": 0}


def test_a_client_salt_is_mixed_into_the_tenants_never_replaces_it(secure_stack):
    tokens = _prompt(777)
    _warm(secure_stack, tokens)
    # a's own salted requests are apart from a's unsalted ones, and share among themselves.
    assert _http(secure_stack, secure_stack.key_a, tokens, cache_salt="job-1")["cached"] == 0
    assert _http(secure_stack, secure_stack.key_a, tokens, cache_salt="job-1")["cached"] > 1000
    # b with the very same client salt is still b.
    assert _http(secure_stack, secure_stack.key_b, tokens, cache_salt="job-1") == {"cached": 0, "predicted": 0}


def test_the_anthropic_door_uses_the_same_tenant(secure_stack):
    """/v1/messages: tenant b with a's x-tenant and salt gets no hit on a's conversation."""
    msgs = [{"role": "user", "content": "tenant isolation through the messages API " * 60}]
    url = secure_stack.http_base + "/v1/messages"
    body = {"model": MODEL, "max_tokens": 2, "messages": msgs}

    def cached(key: str, extra: dict | None = None, **more) -> int:
        r = httpx.post(url, json={**body, **more}, timeout=30,
                       headers={"x-api-key": key, "anthropic-version": "2023-06-01", **(extra or {})})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["cache_read_input_tokens"]

    cached(secure_stack.key_a)
    assert cached(secure_stack.key_a) > 0
    assert cached(secure_stack.key_b, {"x-tenant": "tenant-a"}, cache_salt="tenant:tenant-a") == 0
