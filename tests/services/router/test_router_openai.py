"""The OpenAI-compatible HTTP front door, driven by the official ``openai`` client and raw HTTP."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from kvmesh_tools.testing.procs import ServiceProcess
from tests.fixtures.router import MODEL, RouterStack, keys_args, start_router, start_workers

pytestmark = pytest.mark.timeout(120)
AUTH = {"authorization": "Bearer sk-tenant-a"}
KEYS = "tenant-a sk-tenant-a\ntenant-b sk-tenant-b\n"


@pytest.fixture(scope="module")
def http_stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir) -> Iterator[RouterStack]:
    tmp = tmp_path_factory.mktemp("router-http")
    started: list[ServiceProcess] = []
    try:
        ws = start_workers(tmp, ["w1", "w2"])
        started.extend(ws.values())
        w, w2 = ws["w1"], ws["w2"]
        router, http = start_router(tmp, [("w1", w.grpc_address), ("w2", w2.grpc_address)],
                                    extra=["--tokenizer-path", str(tiny_model_dir), "--max-prompt-tokens", "4000",
                                           "--max-text-bytes", "200000",
                                           *keys_args(tmp, KEYS)])
        started.append(router)
        yield RouterStack(router, http, {"w1": w, "w2": w2})
    finally:
        for p in reversed(started):
            p.stop(grace_s=3)


@pytest.fixture
def client(http_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=http_stack.http_base + "/v1", api_key="sk-tenant-a", max_retries=0, timeout=30)


def test_models_and_health(client, http_stack):
    assert [m.id for m in client.models.list().data] == [MODEL]
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model" and card.model_extra["max_model_len"] > 0
    for missing in ("other-model", "org/other-model"):   # an id with "/" is one path parameter
        with pytest.raises(openai.NotFoundError) as ei:
            client.models.retrieve(missing)
        assert missing in ei.value.message
    r = httpx.get(http_stack.http_base + f"/v1/models/{MODEL}", timeout=5)
    assert r.status_code == 401   # behind the keys, as the list is
    r = httpx.get(http_stack.http_base + "/health", timeout=5)
    assert r.status_code == 200 and r.json()["live_endpoints"] == 2


def test_completions_non_streaming_reports_cached_tokens(client):
    prompt = "The quick brown fox jumps over the lazy dog. " * 40
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    assert first.usage.completion_tokens == 5 and first.choices[0].finish_reason == "length"
    assert isinstance(first.choices[0].text, str)
    second = client.completions.create(model=MODEL, prompt=prompt + " And then?", max_tokens=5)
    details = second.usage.prompt_tokens_details
    assert details.cached_tokens > 0
    assert second.model_extra["kvmesh"]["predicted_cached_tokens"] == details.cached_tokens


def test_completions_streaming_ends_with_done(client, http_stack):
    chunks = list(client.completions.create(model=MODEL, prompt="hello world " * 20, max_tokens=6, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)
    with httpx.stream("POST", http_stack.http_base + "/v1/completions", timeout=30, headers=AUTH,
                      json={"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"


def test_chat_streaming_and_not(client):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
    resp = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)
    assert resp.choices[0].message.role == "assistant" and resp.usage.completion_tokens == 4
    msgs2 = msgs + [{"role": "assistant", "content": resp.choices[0].message.content or ""},
                    {"role": "user", "content": "Again, " * 30}]
    resp2 = client.chat.completions.create(model=MODEL, messages=msgs2, max_tokens=4)
    assert resp2.usage.prompt_tokens_details.cached_tokens >= 0
    stream = client.chat.completions.create(model=MODEL, messages=msgs2, max_tokens=4, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) is not None


def test_tenants_by_api_key_are_isolated(http_stack):
    prompt = "tenant isolation check " * 30
    a = openai.OpenAI(base_url=http_stack.http_base + "/v1", api_key="sk-tenant-a", max_retries=0)
    b = openai.OpenAI(base_url=http_stack.http_base + "/v1", api_key="sk-tenant-b", max_retries=0)
    a.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert a.completions.create(model=MODEL, prompt=prompt, max_tokens=2).usage.prompt_tokens_details.cached_tokens
    assert b.completions.create(model=MODEL, prompt=prompt, max_tokens=2).usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x"}, "model"),
    ({"model": MODEL}, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": 7}, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": MODEL, "prompt": "x", "n": 3}, "n"),
    ({"model": MODEL, "prompt": [1, 2, 99999999]}, "prompt"),
    ({"model": MODEL, "prompt": "word " * 5000}, "prompt"),
    ({"model": MODEL, "prompt": "x", "top_k": -3}, "top_k"),
    ({"model": MODEL, "prompt": "x", "repetition_penalty": -1}, "repetition_penalty"),
])
def test_bad_completion_requests_get_openai_400s(http_stack, body, param):
    r = httpx.post(http_stack.http_base + "/v1/completions", json=body, timeout=10, headers=AUTH)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_an_unknown_model_is_a_404(http_stack):
    r = httpx.post(http_stack.http_base + "/v1/completions", json={"model": "other", "prompt": "x"}, timeout=10,
                   headers=AUTH)
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["param"] == "model" and err["type"] == "not_found_error" and "unknown model 'other'" in err["message"]


def test_malformed_json_and_bad_messages(http_stack):
    base = http_stack.http_base
    r = httpx.post(base + "/v1/chat/completions", content=b"{not json", timeout=10,
                   headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    r = httpx.post(base + "/v1/chat/completions", json={"model": MODEL, "messages": [{"content": "x"}]},
                   timeout=10, headers=AUTH)
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/chat/completions", json={"model": MODEL}, timeout=10, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(base + "/v1/completions", content=b"x" * 300_000, timeout=10, headers=AUTH)
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"


def test_openai_client_sees_errors(client):
    # An unknown model is "not found", as OpenAI, vLLM and the Anthropic door answer it.
    with pytest.raises(openai.NotFoundError) as ei:
        client.completions.create(model="missing-model", prompt="x", max_tokens=2)
    assert "unknown model" in str(ei.value) and ei.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="org/missing", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=9)
