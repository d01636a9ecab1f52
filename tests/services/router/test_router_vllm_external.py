"""The router in front of two plain vLLM OpenAI servers (no kvmesh worker): a team's own fleet.

vLLM saves and restores KV through kvmesh's connector and the shared store, and publishes KV
events to the indexer's central socket (llm-d's topic convention names each
server ``<ip>:<port>``, the id the router gives a bare ``--endpoints`` URL); the router reads each
server's /metrics for load, renders and hashes every chat request itself, and forwards the
client's body with the tenant's cache_salt added. Through the router's HTTP with the
official ``openai`` client, a 20-turn agent conversation with tools: on every turn the
router's predicted cached tokens (``x-kvmesh-predicted-cached-tokens``) equal vLLM's own
``usage.prompt_tokens_details.cached_tokens``; the turns that require a tool get vLLM's
parsed tool call back; another tenant's identical prompt gets no cached token; killing the
vLLM that holds the conversation moves it to the other one, which restores it from the store.
The same fleet behind a real Envoy with the router as ext_proc picker: the picker writes the
tenant's salt into the forwarded body, and predictions equal vLLM's there too. The Messages
API (official ``anthropic`` client) goes to vLLM's own ``/v1/messages``, the Responses API to its
``/v1/responses``, and gRPC ``Generate``
to vLLM's completions with token ids; both predict exactly too. A second router splits P/D
over the two servers (HTTP and gRPC), handing the prompt over through the store.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import anthropic
import grpc
import httpx
import openai
import pytest

from kvmesh.worker.connector import CONNECTOR_MODULE
from kvmesh_api.router.v1 import router_pb2, router_pb2_grpc
from kvmesh_tools.testing.ports import free_port
from kvmesh_tools.testing.procs import ServiceProcess
from tests.fixtures.vllm import TINY_MODEL_NAME

pytestmark = [pytest.mark.vllm, pytest.mark.envoy, pytest.mark.timeout(600)]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"location": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["location"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def fleet(vllm_servers, envoy_factory, tiny_model_dir, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("router-vllm-external")
    central: dict[str, str] = {}

    def indexer_ports() -> tuple[list[str], str]:
        iport, central["port"] = free_port(), str(free_port())
        return (["--host", "127.0.0.1", "--port", str(iport), "--models", f"{TINY_MODEL_NAME}@32@sha256_cbor",
                 "--default-model", TINY_MODEL_NAME, "--kv-events-bind", f"tcp://127.0.0.1:{central['port']}",
                 "--kv-events-replay", f"ipc://{tmp}/replay-{{port}}.sock"], f"127.0.0.1:{iport}")

    idx = ServiceProcess.on_fresh_ports("indexer", indexer_ports, log_path=tmp / "indexer.log").start(60)
    router = store = None
    try:
        # The shared store, registered with the indexer for every model; its events index what it holds.
        store = ServiceProcess.with_ports("offload", lambda sp, ev: [
            "--host", "127.0.0.1", "--port", str(sp), "--endpoint-id", "store-0", "--ram-capacity-bytes",
            str(256 << 20), "--events-endpoint", f"tcp://*:{ev}", "--indexer-address", idx.grpc_address,
            "--advertise-host", "127.0.0.1"], count=2, log_path=tmp / "offload.log").start(60)
        connector = {"kv_connector": "KvmeshConnector", "kv_connector_module_path": CONNECTOR_MODULE,
                     "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                     "kv_connector_extra_config": {"store_address": store.grpc_address}}
        servers = vllm_servers(["v1", "v2"], f"tcp://127.0.0.1:{central['port']}", tmp,
                               kv_transfer=lambda _eid: connector)
        # A lookup past --lookup-timeout-s is answered by the router's local view (what earlier
        # lookups learned), which misses what the last turn added: on this shared, loaded machine
        # the indexer gets a deadline long enough that every prediction is the index's.
        router = ServiceProcess.with_ports("router", lambda port, http, metrics_port, extproc_port: [
            "--metrics-port", str(metrics_port), "--lookup-timeout-s", "2", "--lookup-late-s", "4",
            "--extproc-port", str(extproc_port),
            "--host", "127.0.0.1", "--port", str(port), "--http-port", str(http), "--model", TINY_MODEL_NAME,
            "--block-size", "32", "--hash-algo", "sha256_cbor", "--indexer", idx.grpc_address, "--auth", "off",
            "--tokenizer-path", str(tiny_model_dir), "--speculative-ttl-s", "0.3", "--max-model-len", "4096",
            "--endpoints", ",".join(s.url for s in servers)], count=4, log_path=tmp / "router.log").start(60)
        port, http = router.port, router.flag_port("--http-port")
        metrics_port, extproc_port = router.flag_port("--metrics-port"), router.flag_port("--extproc-port")
        base = f"http://127.0.0.1:{http}"
        deadline = time.monotonic() + 30
        while httpx.get(base + "/health", timeout=5).json().get("live_endpoints") != 2:
            assert time.monotonic() < deadline, "the router never saw both vLLM servers up"
            time.sleep(0.2)
        # The same fleet behind Envoy, the router as its ext_proc endpoint picker.
        gateway = envoy_factory(extproc_port, [s.port for s in servers], fail_open=False, name="gateway")
        yield {"base": base, "grpc": f"127.0.0.1:{port}", "indexer": idx.grpc_address, "tmp": tmp,
               "model_dir": tiny_model_dir, "servers": {s.endpoint_id: s for s in servers}, "router_log": tmp / "router.log",
               "metrics": f"http://127.0.0.1:{metrics_port}/metrics", "gateway": gateway.base}
    finally:
        if router is not None:
            router.stop(grace_s=5)
        if store is not None:
            store.stop(grace_s=5)
        idx.stop(grace_s=5)


def _client(fleet: dict, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet["base"] + "/v1", api_key="k", max_retries=0, timeout=120,
                         default_headers={"x-tenant": tenant})


def _turn(client: openai.OpenAI, messages: list[dict], **kw) -> tuple[object, int, str]:
    raw = client.chat.completions.with_raw_response.create(model=TINY_MODEL_NAME, messages=messages, tools=TOOLS,
                                                            temperature=0.0, **kw)
    return raw.parse(), int(raw.headers["x-kvmesh-predicted-cached-tokens"]), raw.headers["x-kvmesh-endpoint"]


def _streamed_turn(client: openai.OpenAI, messages: list[dict], **kw) -> tuple[object, int, str]:
    """A streamed turn (SSE passed through from vLLM): (the last chunk, with usage; content; ...)."""
    raw = client.chat.completions.with_raw_response.create(
        model=TINY_MODEL_NAME, messages=messages, tools=TOOLS, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, **kw)
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    last = chunks[-1]
    assert last.usage is not None and any(c.choices and c.choices[0].finish_reason for c in chunks)
    return (last, text), int(raw.headers["x-kvmesh-predicted-cached-tokens"]), raw.headers["x-kvmesh-endpoint"]


def _lookups(fleet: dict) -> list[str]:
    """The router's lookup outcomes so far (ok / local / late_merged), for a failure's message."""
    text = httpx.get(fleet["metrics"], timeout=5).text
    return [line for line in text.splitlines() if line.startswith("kvmesh_router_lookups_total")]


def _opening(topic: str) -> list[dict]:
    return [{"role": "system", "content": "You are a coding agent. Use the tools when they help. " * 6},
            {"role": "user", "content": f"Plan the refactor of {topic}, then check the weather."}]


def test_twenty_turns_with_tools_predictions_equal_vllm(fleet) -> None:
    client = _client(fleet, "acme")
    messages = _opening("the parser module")
    endpoints, calls = [], 0
    for turn in range(20):
        wants_tool = turn % 4 == 1
        if turn % 4 == 3:   # some turns stream: vLLM's SSE goes through untouched
            (r, streamed_text), predicted, eid = _streamed_turn(client, messages, max_tokens=8, tool_choice="none")
        else:
            r, predicted, eid = _turn(client, messages, max_tokens=64 if wants_tool else 8,
                                      tool_choice="required" if wants_tool else "none")
        cached = r.usage.prompt_tokens_details.cached_tokens
        assert predicted == cached, (turn, eid, predicted, cached, r.usage, _lookups(fleet))
        if turn:
            assert cached > 0, turn
        endpoints.append(eid)
        msg = r.choices[0].message if turn % 4 != 3 else None
        if wants_tool:
            # vLLM parsed the call out of what the model wrote (guided by the tool's schema).
            assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls, r
            call = msg.tool_calls[0]
            assert call.function.name == "get_weather"
            assert json.loads(call.function.arguments)["location"] in ("Paris", "Rome")
            calls += 1
            messages += [{"role": "assistant", "content": None, "tool_calls": [
                             {"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                         {"role": "tool", "tool_call_id": call.id, "content": f"Sunny, {turn + 12} C"}]
        else:
            content = streamed_text if msg is None else (msg.content or "")
            messages += [{"role": "assistant", "content": content},
                         {"role": "user", "content": f"Step {turn}: now look at file_{turn}.py and continue."}]
        time.sleep(0.4)   # past the speculative TTL: predictions rest on vLLM's own events
    assert calls == 5
    assert len(set(endpoints[1:])) == 1, endpoints   # the conversation stays with its KV


def test_through_envoy_the_picker_salts_and_predicts(fleet) -> None:
    """Envoy forwards the client's request to the vLLM the picker chose, with the tenant's salt
    written into the body: predictions equal vLLM's, tool calls are vLLM's, tenants stay apart."""
    def client(tenant: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=fleet["gateway"] + "/v1", api_key="k", max_retries=0, timeout=120,
                             default_headers={"x-tenant": tenant})

    messages = _opening("the gateway config")
    picked = []
    for turn in range(6):
        wants_tool = turn % 3 == 1
        raw = client("globex").chat.completions.with_raw_response.create(
            model=TINY_MODEL_NAME, messages=messages, tools=TOOLS, temperature=0.0,
            max_tokens=64 if wants_tool else 8, tool_choice="required" if wants_tool else "none")
        r = raw.parse()
        predicted = int(raw.headers["x-kvmesh-predicted-cached-tokens"])
        assert predicted == r.usage.prompt_tokens_details.cached_tokens, (turn, predicted, r.usage)
        if turn:
            assert predicted > 0
        picked.append(raw.headers["x-kvmesh-picked-endpoint"])
        msg = r.choices[0].message
        if wants_tool:
            call = msg.tool_calls[0]
            assert call.function.name == "get_weather"
            messages += [{"role": "assistant", "content": None, "tool_calls": [
                             {"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                         {"role": "tool", "tool_call_id": call.id, "content": "Rain"}]
        else:
            messages += [{"role": "assistant", "content": msg.content or ""},
                         {"role": "user", "content": f"Gateway step {turn}."}]
        time.sleep(0.4)
    assert len(set(picked)) == 1 and picked[0] in fleet["servers"], picked
    # Another tenant's identical conversation: the picker salted its body differently.
    raw = client("initech").chat.completions.with_raw_response.create(
        model=TINY_MODEL_NAME, messages=messages, tools=TOOLS, temperature=0.0, max_tokens=2, tool_choice="none")
    assert raw.parse().usage.prompt_tokens_details.cached_tokens == int(
        raw.headers["x-kvmesh-predicted-cached-tokens"]) == 0


def test_responses_through_envoy_predict_exactly(fleet) -> None:
    """/v1/responses through Envoy: the picker converts the body as vLLM's /v1/responses does, so its
    prediction equals vLLM's cached tokens on a tool-call history too."""
    client = openai.OpenAI(base_url=fleet["gateway"] + "/v1", api_key="k", max_retries=0, timeout=120,
                           default_headers={"x-tenant": "umbrella"})
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    history: list[dict] = [{"role": "user", "content": "Check the weather, then plan the gateway work."}]
    for turn in range(4):
        wants_tool = turn == 1
        raw = client.responses.with_raw_response.create(
            model=TINY_MODEL_NAME, instructions="You are a coding agent. " * 12, input=history, tools=tools,
            temperature=0.0, store=False, max_output_tokens=64 if wants_tool else 8,
            tool_choice={"type": "function", "name": "get_weather"} if wants_tool else "none")
        r = raw.parse()
        predicted = int(raw.headers["x-kvmesh-predicted-cached-tokens"])
        assert predicted == r.usage.input_tokens_details.cached_tokens, (turn, predicted, r.usage)
        if turn:
            assert predicted > 0
        if wants_tool:
            [call] = [o for o in r.output if o.type == "function_call"]
            history += [{"type": "function_call", "call_id": call.call_id, "name": call.name,
                         "arguments": call.arguments},
                        {"type": "function_call_output", "call_id": call.call_id, "output": "Rain"}]
        else:
            history += [{"role": "assistant", "content": r.output_text or "ok"},
                        {"role": "user", "content": f"Gateway step {turn}."}]
        time.sleep(0.4)


def test_tenants_do_not_share_kv(fleet) -> None:
    messages = _opening("the tenant billing job")
    first, _, eid = _turn(_client(fleet, "tenant-a"), messages, max_tokens=2, tool_choice="none")
    time.sleep(0.4)
    again, predicted, _ = _turn(_client(fleet, "tenant-a"), messages, max_tokens=2, tool_choice="none")
    assert again.usage.prompt_tokens_details.cached_tokens == predicted > 0
    time.sleep(0.4)
    other, predicted, _ = _turn(_client(fleet, "tenant-b"), messages, max_tokens=2, tool_choice="none")
    assert other.usage.prompt_tokens_details.cached_tokens == predicted == 0


ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "The weather in a city.",
                    "input_schema": {"type": "object", "properties": {"location": {"type": "string",
                                                                                   "enum": ["Paris", "Rome"]}},
                                     "required": ["location"], "additionalProperties": False}}]


def test_messages_api_through_vllms_own_messages(fleet) -> None:
    """The official anthropic client through the router: vLLM's /v1/messages answers (its tool
    parser, its events), and every turn's prediction equals vLLM's cache_read_input_tokens."""
    client = anthropic.Anthropic(base_url=fleet["base"], api_key="k", max_retries=0, timeout=120,
                                 default_headers={"x-tenant": "acme"})
    system = "You are a coding agent. Use the tools when they help. " * 6
    messages: list[dict] = [{"role": "user", "content": "Plan the refactor of the lexer, then check the weather."}]
    endpoints, calls = [], 0
    for turn in range(8):
        wants_tool = turn % 4 == 1
        kw = dict(model=TINY_MODEL_NAME, system=system, messages=messages, tools=ANTHROPIC_TOOLS,
                  extra_body={"temperature": 0.0}, max_tokens=64 if wants_tool else 8,
                  tool_choice={"type": "tool", "name": "get_weather"} if wants_tool else {"type": "none"})
        if turn % 4 == 3:   # streamed: vLLM's events pass through
            with client.messages.stream(**kw) as stream:
                m = stream.get_final_message()
                headers = stream.response.headers
        else:
            raw = client.messages.with_raw_response.create(**kw)
            m, headers = raw.parse(), raw.headers
        predicted, eid = int(headers["x-kvmesh-predicted-cached-tokens"]), headers["x-kvmesh-endpoint"]
        cached = m.usage.cache_read_input_tokens
        assert predicted == cached, (turn, eid, predicted, m.usage, _lookups(fleet))
        if turn:
            assert cached > 0, turn
        endpoints.append(eid)
        if wants_tool:
            use = [b for b in m.content if b.type == "tool_use"]
            assert m.stop_reason == "tool_use" and use, m
            assert use[0].name == "get_weather" and use[0].input["location"] in ("Paris", "Rome")
            calls += 1
            messages += [{"role": "assistant", "content": [{"type": "tool_use", "id": use[0].id,
                                                            "name": use[0].name, "input": use[0].input}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id,
                                                       "content": f"Sunny, {turn + 12} C"}]}]
        else:
            text = "".join(b.text for b in m.content if b.type == "text")
            messages += [{"role": "assistant", "content": text or "ok"},
                         {"role": "user", "content": f"Step {turn}: now look at lex_{turn}.py."}]
        time.sleep(0.4)   # past the speculative TTL: predictions rest on vLLM's own events
    assert calls == 2
    assert len(set(endpoints[1:])) == 1, endpoints


def test_responses_api_through_vllms_own_responses(fleet) -> None:
    """The official openai client's Responses API through the router, as Codex sends it (the whole
    history as input, store false, prompt_cache_key): vLLM's /v1/responses answers (its tool parser,
    its events), and every turn's prediction equals vLLM's input_tokens_details.cached_tokens."""
    client = _client(fleet, "acme")
    # A function tool and a free-form one (vLLM shows it as a one-string function).
    tools = [{"type": "function", **t["function"]} for t in TOOLS] + [
        {"type": "custom", "name": "apply_patch", "description": "Apply a patch to the workspace."}]
    instructions = "You are a coding agent. Use the tools when they help. " * 6
    history: list[dict] = [{"role": "user", "content": "Plan the refactor of the parser, then check the weather."}]
    endpoints, calls = [], 0
    for turn in range(8):
        wants_tool = turn % 4 == 1
        forced = {"type": "function", "name": "get_weather"} if turn == 1 else {"type": "custom", "name": "apply_patch"}
        kw = dict(model=TINY_MODEL_NAME, instructions=instructions, input=history, tools=tools, temperature=0.0,
                  store=False, prompt_cache_key="codex-conv-1", max_output_tokens=64 if wants_tool else 8,
                  tool_choice=forced if wants_tool else "none")
        if turn % 4 == 3:   # streamed: vLLM's events pass through
            raw = client.responses.with_raw_response.create(**kw, stream=True)
            events = list(raw.parse())
            assert events[-1].type == "response.completed", [e.type for e in events]
            r = events[-1].response
        else:
            raw = client.responses.with_raw_response.create(**kw)
            r = raw.parse()
        predicted, eid = int(raw.headers["x-kvmesh-predicted-cached-tokens"]), raw.headers["x-kvmesh-endpoint"]
        cached = r.usage.input_tokens_details.cached_tokens
        assert predicted == cached, (turn, eid, predicted, r.usage, _lookups(fleet))
        if turn:
            assert cached > 0, turn
        endpoints.append(eid)
        if wants_tool and turn == 1:
            [call] = [o for o in r.output if o.type == "function_call"]
            assert call.name == "get_weather" and json.loads(call.arguments)["location"] in ("Paris", "Rome")
            calls += 1
            history += [{"type": "function_call", "call_id": call.call_id, "name": call.name,
                         "arguments": call.arguments},
                        {"type": "function_call_output", "call_id": call.call_id, "output": f"Sunny, {turn + 12} C"}]
        elif wants_tool:   # vLLM unwraps the shim: the call is a custom_tool_call with a text input
            [patch] = [o for o in r.output if o.type == "custom_tool_call"]
            assert patch.name == "apply_patch" and isinstance(patch.input, str)
            calls += 1
            history += [{"type": "custom_tool_call", "call_id": patch.call_id, "name": patch.name,
                         "input": patch.input + " ü"},
                        {"type": "custom_tool_call_output", "call_id": patch.call_id, "output": "Done!"}]
        else:
            history += [{"role": "assistant", "content": r.output_text or "ok"},
                        {"role": "user", "content": f"Step {turn}: now look at parse_{turn}.py."}]
        time.sleep(0.4)   # past the speculative TTL: predictions rest on vLLM's own events
    assert calls == 2
    assert len(set(endpoints[1:])) == 1, endpoints


@pytest.mark.parametrize("door", ["router", "gateway"])
def test_a_stored_conversation_over_vllms_own_responses(fleet, door) -> None:
    """previous_response_id over external vLLM engines, through the router's front door or through Envoy
    with the router as its picker: the router keeps each vLLM answer, sends vLLM each turn as the whole
    conversation (store false), streamed or not, and predicts exactly what vLLM caches of it."""
    router = _client(fleet, "acme")
    client = router if door == "router" else openai.OpenAI(
        base_url=fleet["gateway"] + "/v1", api_key="k", max_retries=0, timeout=120, default_headers={"x-tenant": "acme"})
    instructions = f"You are a coding agent ({door}). Read before you write. " * 8
    prev, endpoints = None, []
    for turn in range(4):
        kw = dict(model=TINY_MODEL_NAME, instructions=instructions, input=f"Step {turn}: look at mod_{turn}.py.",
                  temperature=0.0, max_output_tokens=8, prompt_cache_key=f"stored-conv-{door}")
        if prev is not None:
            kw["previous_response_id"] = prev
        if turn == 2:
            raw = client.responses.with_raw_response.create(**kw, stream=True)
            events = list(raw.parse())
            assert events[0].response.store is True and events[0].response.previous_response_id == prev
            r = events[-1].response
        else:
            raw = client.responses.with_raw_response.create(**kw)
            r = raw.parse()
        assert r.store is True and r.previous_response_id == prev
        predicted, cached = int(raw.headers["x-kvmesh-predicted-cached-tokens"]), r.usage.input_tokens_details.cached_tokens
        assert predicted == cached, (turn, predicted, r.usage, _lookups(fleet))
        if turn:
            assert cached > 0, turn
        endpoints.append(raw.headers["x-kvmesh-endpoint" if door == "router" else "x-kvmesh-picked-endpoint"])
        prev = r.id
        time.sleep(0.4)   # past the speculative TTL: predictions rest on vLLM's own events
    assert router.responses.retrieve(prev).id == prev   # one store behind both doors
    said = [i.content[0].text for i in router.responses.input_items.list(prev, order="asc", limit=100)
            if i.type == "message" and i.role == "user"]
    assert said == [f"Step {t}: look at mod_{t}.py." for t in range(4)]
    assert len(set(endpoints[1:])) == 1, endpoints


def test_grpc_generate_on_external_engines(fleet) -> None:
    """gRPC Generate reaches vLLM as completions of the router's token ids (with the tenant's
    salt): tokens stream back, and the prediction equals vLLM's cached tokens."""
    text = "def parse(tokens):\n    # the recursive-descent parser of the config language\n" * 12
    with grpc.insecure_channel(fleet["grpc"]) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        finals = []
        for turn in range(3):
            req = router_pb2.GenerateRequest(model=TINY_MODEL_NAME, text=text + f"# step {turn}\n" * turn,
                                             return_text=True)
            req.sampling.max_tokens = 4
            req.sampling.temperature = 0.0
            out = list(stub.Generate(req, timeout=120, metadata=[("x-tenant", "acme")]))
            chunks = [m.chunk for m in out if m.HasField("chunk")]
            (fin,) = [m.final for m in out if m.HasField("final")]
            assert sum(len(c.token_ids) for c in chunks) == fin.usage.completion_tokens == 4
            assert fin.finish_reason == 2   # FINISH_REASON_LENGTH
            assert fin.routing.predicted_cached_tokens == fin.usage.cached_tokens, (turn, fin)
            finals.append(fin)
            time.sleep(0.4)
        assert finals[1].usage.cached_tokens > 0 and finals[2].usage.cached_tokens >= finals[1].usage.cached_tokens
        assert len({f.routing.endpoint for f in finals}) == 1
        # Structured outputs reach vLLM as its own structured_outputs field: the answer is a choice.
        req = router_pb2.GenerateRequest(model=TINY_MODEL_NAME, text=text, return_text=True)
        req.sampling.max_tokens = 8
        req.sampling.structured_outputs_json = json.dumps({"choice": ["yes", "no"]})
        out = list(stub.Generate(req, timeout=120, metadata=[("x-tenant", "acme")]))
        assert "".join(m.chunk.text for m in out if m.HasField("chunk")) in ("yes", "no")
        assert out[-1].final.finish_reason == 1   # FINISH_REASON_STOP
    # Another tenant's identical prompt: salted differently, nothing cached.
    with grpc.insecure_channel(fleet["grpc"]) as ch:
        req = router_pb2.GenerateRequest(model=TINY_MODEL_NAME, text=text)
        req.sampling.max_tokens = 1
        (fin,) = [m.final for m in router_pb2_grpc.RouterStub(ch).Generate(
            req, timeout=120, metadata=[("x-tenant", "initech")]) if m.HasField("final")]
        assert fin.usage.cached_tokens == fin.routing.predicted_cached_tokens == 0


@pytest.fixture(scope="module")
def pd_router(fleet) -> Iterator[dict]:
    """A second router over the same two vLLM servers: the first decodes, the second prefills."""
    decode, prefill = fleet["servers"].values()
    router = ServiceProcess.with_ports("router", lambda port, http: [
        "--lookup-timeout-s", "2", "--lookup-late-s", "4", "--host", "127.0.0.1", "--port", str(port),
        "--http-port", str(http), "--model", TINY_MODEL_NAME, "--block-size", "32", "--hash-algo", "sha256_cbor",
        "--indexer", fleet["indexer"], "--auth", "off", "--tokenizer-path", str(fleet["model_dir"]),
        "--max-model-len", "4096", "--endpoints", decode.url, "--prefill-endpoints", prefill.url,
        "--split-enabled", "--split-threshold-tokens", "64", "--split-store-wait-s", "20"],
        count=2, log_path=fleet["tmp"] / "router-pd.log").start(60)
    port, http = router.port, router.flag_port("--http-port")
    try:
        base = f"http://127.0.0.1:{http}"
        deadline = time.monotonic() + 30
        while httpx.get(base + "/health", timeout=5).json().get("live_endpoints") != 1:
            assert time.monotonic() < deadline, "the P/D router never saw its decode server up"
            time.sleep(0.2)
        yield {"base": base, "grpc": f"127.0.0.1:{port}", "decode": decode.endpoint_id, "prefill": prefill.endpoint_id}
    finally:
        router.stop(grace_s=5)


def test_pd_split_hands_the_prompt_over_through_the_store(pd_router) -> None:
    """llm-d's P/D convention with kvmesh's store as the transport: the prefill vLLM computes the
    prompt (max_tokens 1) and its connector saves it; the decode vLLM restores it from the store,
    exactly as much as the router predicted."""
    for turn, stream in enumerate((False, True)):
        # A tenant per turn: nothing of the prompt is cached anywhere, so the split rule splits.
        client = openai.OpenAI(base_url=pd_router["base"] + "/v1", api_key="k", max_retries=0, timeout=120,
                               default_headers={"x-tenant": f"pd-{turn}"})
        messages = _opening(f"the P/D split, part {turn}")
        kw = dict(model=TINY_MODEL_NAME, messages=messages, temperature=0.0, max_tokens=4)
        if stream:
            raw = client.chat.completions.with_raw_response.create(**kw, stream=True,
                                                                    stream_options={"include_usage": True})
            usage = list(raw.parse())[-1].usage
        else:
            raw = client.chat.completions.with_raw_response.create(**kw)
            usage = raw.parse().usage
        h = raw.headers
        assert h.get("x-kvmesh-split") == "true", h.get("x-kvmesh-split-reason")
        assert h["x-kvmesh-prefill-endpoint"] == pd_router["prefill"]
        assert h["x-kvmesh-endpoint"] == pd_router["decode"]
        cached = usage.prompt_tokens_details.cached_tokens
        # Every full block but the one holding the last prompt token (vLLM computes that one).
        assert cached == int(h["x-kvmesh-predicted-cached-tokens"]) == (usage.prompt_tokens - 1) // 32 * 32 > 0, (
            turn, usage, dict(h))


def test_pd_split_on_grpc_generate(pd_router) -> None:
    """gRPC Generate splits the same way: vLLM's completions with the router's token ids, prefill
    only on the prefill vLLM, then streamed from the decode vLLM, which restores the prompt from
    the store exactly as predicted."""
    text = "def schedule(jobs):\n    # the P/D split over gRPC, one job at a time\n" * 10
    with grpc.insecure_channel(pd_router["grpc"]) as ch:
        req = router_pb2.GenerateRequest(model=TINY_MODEL_NAME, text=text, return_text=True)
        req.sampling.max_tokens = 4
        req.sampling.temperature = 0.0
        out = list(router_pb2_grpc.RouterStub(ch).Generate(req, timeout=120, metadata=[("x-tenant", "pd-grpc")]))
    (fin,) = [m.final for m in out if m.HasField("final")]
    assert sum(len(m.chunk.token_ids) for m in out if m.HasField("chunk")) == fin.usage.completion_tokens == 4
    assert fin.routing.split, fin.routing.reason
    assert fin.routing.prefill_endpoint == pd_router["prefill"] and fin.routing.endpoint == pd_router["decode"]
    assert fin.usage.cached_tokens == fin.routing.predicted_cached_tokens == (
        fin.usage.prompt_tokens - 1) // 32 * 32 > 0, fin
    # The prefill vLLM found none of this tenant's prompt cached: what the decode vLLM restored
    # was computed for this request, a transfer and not a hit.
    assert fin.routing.reused_tokens == 0 and fin.routing.transferred_tokens == fin.usage.cached_tokens, fin


def test_killing_the_vllm_that_holds_a_conversation_moves_it(fleet) -> None:
    client = _client(fleet, "acme")
    messages = _opening("the scheduler")
    _, _, holder = _turn(client, messages, max_tokens=2, tool_choice="none")
    time.sleep(0.4)
    _, _, again = _turn(client, messages, max_tokens=2, tool_choice="none")
    assert again == holder
    fleet["servers"][holder].kill()
    raw = client.chat.completions.with_raw_response.create(
        model=TINY_MODEL_NAME, messages=messages, tools=TOOLS, temperature=0.0, max_tokens=2, tool_choice="none")
    r, moved = raw.parse(), raw.headers["x-kvmesh-endpoint"]
    assert moved != holder and r.choices[0].finish_reason in ("length", "stop")
    # The other server restores the conversation's prefix from the store, as the router predicted.
    assert int(raw.headers["x-kvmesh-predicted-cached-tokens-offload"]) > 0
    assert int(raw.headers["x-kvmesh-predicted-cached-tokens"]) == r.usage.prompt_tokens_details.cached_tokens
    health = httpx.get(fleet["base"] + "/health", timeout=5).json()
    assert health["live_endpoints"] == 1
