"""The router's FastAPI app with the Responses API mounted, over a service that stands in for the routing
below the HTTP layer: what reaches ``generate`` (the rendered conversation, the session), tool calls from a
worker that does not stream its parse, and an error mid-stream. Everything above ``generate`` (the app, the
Responses handlers, the official ``openai`` client) is the real code; the real round trip is in
``test_router_responses.py``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx2
import openai
import pytest

from kvmesh.tokenization import load_tokenizer
from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.router.v1 import router_pb2
from kvmesh_router.config import RouterConfig
from kvmesh_router.errors import Unavailable, UnknownModel
from kvmesh_router.http_api import build_app
from kvmesh_router.service import FinalInfo, GenInput

TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file.",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]
CALLS = [{"id": "call_7", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}},
         {"id": "call_8", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "b.py"}'}}]


class _Call:
    def __init__(self, d: dict[str, Any]) -> None:
        self.id, self.name, self.arguments = d["id"], d["function"]["name"], d["function"]["arguments"]


class _RoutedService:
    """What ``RouterService.generate`` yields for a request the engine answered with two tool calls,
    reported whole at the end (a worker that does not stream its parse); or an error mid-stream."""

    def __init__(self, tokenizer: Any) -> None:
        self.cfg = RouterConfig(model="m", auth="off")
        self.tokenizer = tokenizer
        self.seen: list[GenInput] = []
        self.fail_after_first = False

    def validate(self, inp: GenInput) -> None:
        if inp.model != self.cfg.model:
            raise UnknownModel(inp.model, self.cfg.model)

    async def generate(self, inp: GenInput) -> AsyncIterator[tuple[str, Any]]:
        self.seen.append(inp)
        self.rendered = self.tokenizer.render(inp.chat_request)
        ids = self.tokenizer.encode("Let me read them.<tool_call>...</tool_call>")
        yield "chunk", ids
        if self.fail_after_first:
            raise Unavailable("every endpoint is down")
        fin = FinalInfo(common_pb2.Usage(prompt_tokens=50, completion_tokens=len(ids), cached_tokens=32,
                                         cached_tokens_gpu=32), common_pb2.FINISH_REASON_TOOL_CALLS,
                        router_pb2.RoutingDecision(endpoint="w1"), inp.request_id, 0.01, ids)
        calls = [_Call(c) for c in CALLS]
        # As RouterService.generate reports them: parallel_tool_calls false keeps the first call only.
        fin.tool_calls = calls if inp.chat_request.parallel_tool_calls else calls[:1]   # type: ignore[assignment]
        fin.content = "Let me read them."
        yield "final", fin


@pytest.fixture
def routed(tiny_model_dir):
    service = _RoutedService(load_tokenizer(tiny_model_dir))
    app = build_app(service)  # type: ignore[arg-type]
    client = openai.AsyncOpenAI(base_url="http://router/v1", api_key="k", max_retries=0,
                                http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app)))
    return service, client


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel", [True, False])
async def test_whole_tool_calls_become_function_call_items(routed, stream, parallel):
    service, client = routed
    kw: dict[str, Any] = dict(model="m", input="Read a.py and b.py.", tools=TOOLS, max_output_tokens=32,
                              parallel_tool_calls=parallel)
    if stream:
        events = [e async for e in await client.responses.create(**kw, stream=True)]
        # The text was held back until the final report said which part is a call.
        assert [e.delta for e in events if e.type == "response.output_text.delta"] == ["Let me read them."]
        r = events[-1].response
        assert [o.model_dump() for o in r.output] == [e.item.model_dump() for e in events
                                                      if e.type == "response.output_item.done"]
    else:
        r = await client.responses.create(**kw)
    want = CALLS if parallel else CALLS[:1]
    assert [o.type for o in r.output] == ["message"] + ["function_call"] * len(want)
    assert r.output[0].content[0].text == "Let me read them."
    assert [(o.call_id, o.name, o.arguments) for o in r.output[1:]] == [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in want]
    assert r.status == "completed"
    assert (r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens) == (50, 32)
    assert '"name": "read_file"' in service.rendered and service.seen[-1].chat_request.tools_active


async def test_the_conversation_and_the_session_reach_the_router(routed, tiny_model_dir):
    service, client = routed
    history = [{"role": "developer", "content": "ctx"}, {"role": "user", "content": "Read a.py."},
               {"type": "function_call", "call_id": "c1", "name": "read_file", "arguments": '{"path": "a.py"}'},
               {"type": "function_call_output", "call_id": "c1", "output": "x = 1"}]
    await client.responses.create(model="m", instructions="Be brief.", input=history, tools=TOOLS,
                                  prompt_cache_key="conv-9", user="u1")
    inp = service.seen[-1]
    assert inp.session_id == "conv-9"   # OpenAI's cache key is the session, before user
    chat = [{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "ctx"},
            {"role": "user", "content": "Read a.py."},
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "read_file", "arguments": '{"path": "a.py"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "x = 1"}]
    assert inp.chat_request.messages == chat
    await client.responses.create(model="m", input="hi", user="u1")
    assert service.seen[-1].session_id == "u1"
    await client.responses.create(model="m", input="hi", extra_headers={"x-session-id": "h1"})
    assert service.seen[-1].session_id == "h1"


async def test_an_error_mid_stream_is_response_failed(routed):
    service, client = routed
    service.fail_after_first = True
    events = [e async for e in await client.responses.create(model="m", input="hi", stream=True)]
    assert events[-1].type == "response.failed"
    assert "every endpoint is down" in events[-1].response.error.message
    assert [e.sequence_number for e in events] == list(range(len(events)))
