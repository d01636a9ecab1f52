"""A real Envoy in front of the sim workers, with the kvmesh router as its ext_proc endpoint picker.

Envoy runs the shipped ``deploy/envoy/envoy.yaml`` (addresses rewritten to loopback):
ORIGINAL_DST cluster keyed on ``x-gateway-destination-endpoint``, ext_proc pointing at
the router's picker port. OpenAI requests go through Envoy; each response says which
worker served it (``x-kvmesh-endpoint``, set by the worker) and which one the picker
chose (``x-kvmesh-picked-endpoint``, set by the picker on the response).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import pytest

from kvmesh_router.extproc import EXTPROC_SERVICE_NAME, ExtProcConfig, PickResult, start_extproc_server
from kvmesh_tools.testing.ports import free_port

pytestmark = [pytest.mark.envoy, pytest.mark.timeout(300)]
MODEL = "tiny"


@pytest.fixture(scope="module")
def gateway(deploy_stack, envoy_factory):
    decode_ports = [deploy_stack.worker_http[e] for e in ("decode-1", "decode-2")]
    return envoy_factory(deploy_stack.extproc_port, decode_ports, fail_open=False, name="gateway")


def served_by(r: httpx.Response, stack) -> tuple[str, str]:
    """(worker that answered, worker the picker chose)."""
    picked = r.headers.get("x-kvmesh-picked-endpoint", "")
    return r.headers.get("x-kvmesh-endpoint", ""), stack.endpoint_of(picked) if picked else ""


def test_extproc_health_serves_its_service_name(deploy_stack) -> None:
    r = subprocess.run([sys.executable, "-m", "kvmesh.rpc.healthcheck", f"127.0.0.1:{deploy_stack.extproc_port}",
                        "--service", EXTPROC_SERVICE_NAME], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "SERVING" in r.stdout, r.stderr


def test_requests_reach_the_endpoint_the_router_picked(deploy_stack, gateway) -> None:
    seen = set()
    with httpx.Client(base_url=gateway.base, timeout=30) as c:
        for i in range(6):
            prompt = [1000 + 50 * i + j for j in range(70)]
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3})
            assert r.status_code == 200, r.text
            worker, picked = served_by(r, deploy_stack)
            assert worker == picked and worker.startswith("decode-"), (worker, picked)
            assert r.json()["usage"]["completion_tokens"] == 3
            seen.add(worker)
        # streaming chat goes the same way
        r = c.post("/v1/chat/completions", json={"model": MODEL, "stream": True, "max_tokens": 4,
                                                 "messages": [{"role": "user", "content": "stream through envoy"}]})
        assert r.status_code == 200, r.text
        worker, picked = served_by(r, deploy_stack)
        assert worker == picked
        assert r.text.rstrip().endswith("data: [DONE]")
    assert seen <= {"decode-1", "decode-2"}


def _turn_sticks(c: httpx.Client, stack, home: dict[str, str], session: str, body: dict) -> dict:  # noqa: ANN001
    """One turn of ``session`` through the gateway: it lands on the worker the picker chose and, after
    the first turn (which sets ``home``), on the session's home with most of the prompt (the
    previous turns) served from the cache. Returns the response body."""
    r = c.post("/v1/chat/completions", json=body, headers={"x-session-id": session})
    assert r.status_code == 200, r.text
    worker, picked = served_by(r, stack)
    assert worker == picked
    out = r.json()
    if session not in home:
        home[session] = worker
    else:
        assert worker == home[session], f"session {session} left its KV on {home[session]}"
        usage = out["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] // 2, usage
    return out


def test_session_turns_stick_to_their_kv(deploy_stack, gateway) -> None:
    """Two agent sessions, three turns each, interleaved: every turn lands where its KV is."""
    # Agent-sized system prompts (~1k tokens): the cached prefix must outweigh the load
    # differences a busy CI machine shows between two idle workers.
    sessions = {
        "a": [{"role": "system", "content": "You are agent A. " + "alpha " * 600}],
        "b": [{"role": "system", "content": "You are agent B. " + "bravo " * 600}],
    }
    home: dict[str, str] = {}
    with httpx.Client(base_url=gateway.base, timeout=30) as c:
        for turn in range(3):
            for name, msgs in sessions.items():
                msgs.append({"role": "user", "content": f"turn {turn} of session {name}: do step {turn}"})
                body = _turn_sticks(c, deploy_stack, home, name, {"model": MODEL, "messages": msgs, "max_tokens": 4})
                msgs.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})


def test_tenants_stay_apart_behind_envoy(deploy_stack, gateway) -> None:
    """The picker hands the worker the tenant's secret salt (the body's cache_salt is replaced,
    the client's mixed in): another tenant, or a client guessing the salt, gets no cache hit.
    (This stack runs the router with --auth off, so the claimed x-tenant is the tenant.)"""
    prompt = [3000 + j for j in range(600)]

    def cached(headers: dict[str, str], **body) -> int:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2, **body},
                   headers=headers)
        assert r.status_code == 200, r.text
        worker, picked = served_by(r, deploy_stack)
        assert worker == picked
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    with httpx.Client(base_url=gateway.base, timeout=30) as c:
        cached({"x-tenant": "t1"})
        assert cached({"x-tenant": "t1"}) > 0
        assert cached({"x-tenant": "t2"}) == 0
        assert cached({}, cache_salt="tenant:t1") == 0
        assert cached({"x-tenant": "t2"}, cache_salt="t1") == 0


def test_agent_turns_with_tools_stick_to_their_kv(deploy_stack, gateway) -> None:
    """Tool-using agents: the picker renders tools, tool calls and tool results exactly as the worker
    behind Envoy does, so every turn lands where its KV is and most of it is cached."""
    from tests.helpers.chat_cases import TOOLS

    sessions = {n: [{"role": "system", "content": f"You are tool agent {n}. " + f"{n} " * 500}]
                for n in ("tc", "td")}
    home: dict[str, str] = {}
    with httpx.Client(base_url=gateway.base, timeout=30) as c:
        for turn in range(3):
            for name, msgs in sessions.items():
                msgs.append({"role": "user", "content": [{"type": "text", "text": f"turn {turn}"},
                                                         {"type": "text", "text": f"of {name}"}]})
                body = _turn_sticks(c, deploy_stack, home, name,
                                    {"model": MODEL, "messages": msgs, "max_tokens": 4, "tools": TOOLS})
                [call] = body["choices"][0]["message"]["tool_calls"]   # the sim's tool mode
                msgs += [{"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": call["id"], "content": f"result {turn}"}]


def test_subset_hint_is_honoured_and_an_empty_choice_is_503(deploy_stack, gateway) -> None:
    with httpx.Client(base_url=gateway.base, timeout=30) as c:
        for target in ("decode-1", "decode-2"):
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": [4242, 4243, 4244] * 30, "max_tokens": 2},
                       headers={"x-gateway-destination-endpoint-subset": deploy_stack.http_address(target)})
            assert r.status_code == 200, r.text
            assert served_by(r, deploy_stack) == (target, target)
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2},
                   headers={"x-gateway-destination-endpoint-subset": f"127.0.0.1:{free_port()}"})
        assert r.status_code == 503, r.text
        assert "error" in r.json()


def test_bad_requests_are_rejected_by_the_picker(gateway) -> None:
    with httpx.Client(base_url=gateway.base, timeout=30) as c:
        r = c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"model": MODEL})
        assert r.status_code == 400, r.text
        r = c.post("/v1/completions", json={"model": "no-such-model", "prompt": [1, 2, 3]})
        assert r.status_code in (400, 404), r.text


def test_picker_down_fails_closed_or_open_as_configured(deploy_stack, envoy_factory) -> None:
    dead = free_port()   # nothing listens: the ext_proc call fails
    decode_ports = [deploy_stack.worker_http[e] for e in ("decode-1", "decode-2")]
    closed = envoy_factory(dead, decode_ports, fail_open=False, name="fail-closed")
    opened = envoy_factory(dead, decode_ports, fail_open=True, name="fail-open")
    body = {"model": MODEL, "prompt": [11, 12, 13, 14], "max_tokens": 2}
    r = httpx.post(closed.base + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 503, (r.status_code, r.text)
    for _ in range(5):   # deterministic, not a race with the body stream (the picker has no healthy host)
        r = httpx.post(opened.base + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
    # served by a pool member through the fallback cluster, without a pick
    assert r.headers["x-kvmesh-endpoint"] in {"decode-1", "decode-2"}
    assert "x-kvmesh-picked-endpoint" not in r.headers


async def test_picker_that_dies_fails_over_as_configured(deploy_stack, envoy_factory) -> None:
    """The picker answers, then stops: fail-open keeps serving without picks, fail-closed says 503."""
    target = deploy_stack.http_address("decode-2")

    async def pick(_req):
        return PickResult(address=target, endpoint_id="decode-2")

    decode_ports = [deploy_stack.worker_http[e] for e in ("decode-1", "decode-2")]
    server = await start_extproc_server(pick, 0, host="127.0.0.1", config=ExtProcConfig())
    try:
        opened = await asyncio.to_thread(envoy_factory, server.port, decode_ports, True, "dies-open")
        closed = await asyncio.to_thread(envoy_factory, server.port, decode_ports, False, "dies-closed")
        body = {"model": MODEL, "prompt": [21, 22, 23], "max_tokens": 1}
        async with httpx.AsyncClient(timeout=30) as c:
            for gw in (opened, closed):
                r = await c.post(gw.base + "/v1/completions", json=body)
                assert r.status_code == 200 and r.headers["x-kvmesh-picked-endpoint"] == target, r.text
            await server.stop(0)
            # Envoy's active health check (2 s interval) takes the picker out of its cluster.
            for gw in (opened, closed):
                await _wait_picker_unhealthy(c, gw)
            for _ in range(5):
                r = await c.post(closed.base + "/v1/completions", json=body)
                assert r.status_code == 503, r.text
            for _ in range(5):
                r = await c.post(opened.base + "/v1/completions", json=body)
                assert r.status_code == 200, r.text
                assert "x-kvmesh-picked-endpoint" not in r.headers
    finally:
        await server.stop(0)


async def _wait_picker_unhealthy(c: httpx.AsyncClient, gw, timeout_s: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    text = ""
    while asyncio.get_running_loop().time() < deadline:
        text = (await c.get(f"http://127.0.0.1:{gw.admin_port}/clusters")).text
        if any(line.startswith("kvmesh-epp::") and "health_flags::/failed_active_hc" in line
               for line in text.splitlines()):
            return
        await asyncio.sleep(0.2)
    raise AssertionError("envoy never marked the picker unhealthy:\n" +
                         "\n".join(x for x in text.splitlines() if "health_flags" in x))


async def _hold_connections(release: asyncio.Event) -> tuple[asyncio.AbstractServer, int]:
    """An upstream that accepts and answers only when released (keeps a request in flight)."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await release.wait()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-kvmesh-endpoint: holder\r\n\r\nok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_shedding_answers_429(envoy_factory) -> None:
    """With ``max_inflight=1``, a second request while one is in flight is shed with 429."""
    release = asyncio.Event()
    holder, hport = await _hold_connections(release)

    async def pick(_req):
        return PickResult(address=f"127.0.0.1:{hport}", endpoint_id="holder")

    server = await start_extproc_server(pick, 0, host="127.0.0.1", config=ExtProcConfig(max_inflight=1))
    try:
        gw = await asyncio.to_thread(envoy_factory, server.port, [hport], False, "shed")
        async with httpx.AsyncClient(base_url=gw.base, timeout=30) as c:
            first = asyncio.create_task(c.post("/v1/completions", json={"model": MODEL, "prompt": [1]}))
            for _ in range(100):   # wait until the first request is parked at the upstream
                await asyncio.sleep(0.05)
                if not first.done() and holder.sockets and _inflight(server) == 1:
                    break
            second = await c.post("/v1/completions", json={"model": MODEL, "prompt": [2]})
            assert second.status_code == 429, second.text
            assert "shedding" in second.json()["error"]["message"]
            release.set()
            assert (await first).status_code == 200
            # capacity is back once the first request finished
            for _ in range(50):
                if _inflight(server) == 0:
                    break
                await asyncio.sleep(0.05)
            third = await c.post("/v1/completions", json={"model": MODEL, "prompt": [3]})
            assert third.status_code == 200, third.text
    finally:
        release.set()
        await server.stop(0)
        holder.close()


def _inflight(server) -> int:
    (binding,) = server.bindings
    return binding[1].inflight


def test_stored_responses_chain_through_the_gateway(deploy_stack, gateway) -> None:
    """The official openai client through Envoy, chaining by ``previous_response_id`` and continuing a
    conversation: the picker puts the stored state back into the body the worker gets (which then
    says ``store: false``), and keeps each answer as Envoy passes it back (JSON and a stream); the router's
    own front door reads what the gateway kept, as one store serves both."""
    import openai

    via_gateway = openai.OpenAI(base_url=gateway.base + "/v1", api_key="k", max_retries=0, timeout=60)
    via_router = openai.OpenAI(base_url=f"http://127.0.0.1:{deploy_stack.router_http}/v1", api_key="k",
                               max_retries=0, timeout=60)
    r1 = via_gateway.responses.create(model=MODEL, input="Remember the gateway tag 4417.", max_output_tokens=4)
    assert r1.store is True and r1.output_text
    r2 = via_gateway.responses.create(model=MODEL, previous_response_id=r1.id, input="Which tag?",
                                      max_output_tokens=4)
    assert r2.previous_response_id == r1.id and r2.store is True
    # The worker saw the whole conversation: the first turn's prompt is a prefix of the second's.
    assert r2.usage.input_tokens > r1.usage.input_tokens
    with via_gateway.responses.stream(model=MODEL, previous_response_id=r2.id, input="And again?",
                                      max_output_tokens=4) as stream:
        r3 = stream.get_final_response()
    assert r3.previous_response_id == r2.id and r3.store is True
    got = via_router.responses.retrieve(r3.id)
    assert got.id == r3.id and got.output_text == r3.output_text
    said = [i.content[0].text for i in via_router.responses.input_items.list(r3.id, order="asc").data
            if i.type == "message" and i.role == "user"]
    assert said == ["Remember the gateway tag 4417.", "Which tag?", "And again?"]
    # A conversation made at the router's door, continued through the gateway.
    c = via_router.conversations.create(items=[{"role": "user", "content": "Project: kvmesh."}])
    r4 = via_gateway.responses.create(model=MODEL, conversation=c.id, input="Name it.", max_output_tokens=4)
    assert r4.conversation.id == c.id
    kinds = [(i.type, getattr(i, "role", None)) for i in via_router.conversations.items.list(c.id, order="asc").data]
    assert kinds[:2] == [("message", "user"), ("message", "user")] and ("message", "assistant") in kinds[2:]
    # store: false keeps nothing; an unknown id is the client's 404, not the worker's.
    r5 = via_gateway.responses.create(model=MODEL, input="Forget this.", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        via_router.responses.retrieve(r5.id)
    with pytest.raises(openai.NotFoundError) as e:
        via_gateway.responses.create(model=MODEL, previous_response_id="resp_nope", input="x", max_output_tokens=4)
    assert "resp_nope" in str(e.value)
