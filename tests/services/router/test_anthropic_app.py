"""The router's FastAPI app with the Messages API mounted: tool calls from a worker that does not
stream its parse, and error shapes per path.

Workers stream their tool parse (``parsed`` deltas; the real round trip is in
``test_anthropic_api.py``). One that does not (an older worker) sends token ids and, on its final
report, the calls and the text that is not one; the router then holds the text back. A service whose
``generate`` yields exactly that stands in for the routing below the HTTP layer; everything above it
(the FastAPI app, the Anthropic handlers, the official ``anthropic`` client) is the real code.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx2
import pytest

from kvmesh.tokenization import load_tokenizer
from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.router.v1 import router_pb2
from kvmesh_router.config import RouterConfig
from kvmesh_router.http_api import build_app
from kvmesh_router.service import FinalInfo, GenInput

TOOLS = [{"name": "read_file", "description": "Read a file.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
CALLS = [{"id": "call_7", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]


class _RoutedService:
    """What ``RouterService.generate`` yields, for a request the engine answered with a tool call."""

    def __init__(self, tokenizer: Any) -> None:
        self.cfg = RouterConfig(model="m", auth="off")
        self.tokenizer = tokenizer
        self.seen: list[GenInput] = []

    async def generate(self, inp: GenInput) -> AsyncIterator[tuple[str, Any]]:
        self.seen.append(inp)
        self.rendered = self.tokenizer.render(inp.chat_request)
        inp.prompt_tokens = len(self.tokenizer.encode(self.rendered))
        ids = self.tokenizer.encode("Let me read it.<tool_call>...</tool_call>")
        yield "chunk", ids
        fin = FinalInfo(common_pb2.Usage(prompt_tokens=inp.prompt_tokens, completion_tokens=len(ids) + 9,
                                         cached_tokens=32), common_pb2.FINISH_REASON_STOP,
                        router_pb2.RoutingDecision(endpoint="w1"), inp.request_id, 0.01, ids)
        fin.tool_calls = CALLS   # type: ignore[assignment]  # the final report's calls, in OpenAI's shape
        fin.content = "Let me read it."   # the answer's text that is not a call
        yield "final", fin


@pytest.fixture
def routed(tiny_model_dir):
    service = _RoutedService(load_tokenizer(tiny_model_dir))
    app = build_app(service)  # type: ignore[arg-type]
    client = anthropic.AsyncAnthropic(base_url="http://router", api_key="k", max_retries=0,
                                      http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app)))
    return service, client, app


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_calls_come_back_as_tool_use(routed, stream):
    service, client, _ = routed
    kw: dict[str, Any] = dict(model="m", max_tokens=32, tools=TOOLS,
                              messages=[{"role": "user", "content": "What is in a.py?"}])
    if stream:
        async with client.messages.stream(**kw) as s:
            m = await s.get_final_message()
    else:
        m = await client.messages.create(**kw)
    assert [b.type for b in m.content] == ["text", "tool_use"]
    assert m.content[0].text == "Let me read it."
    tool = m.content[1]
    assert (tool.id, tool.name, tool.input) == ("call_7", "read_file", {"path": "a.py"})
    assert m.stop_reason == "tool_use"
    prompt = service.seen[-1].prompt_tokens
    assert (m.usage.input_tokens, m.usage.cache_read_input_tokens) == (prompt - 32, 32)
    # The tool definitions reached the prompt the router routed, and go to the worker.
    assert '"name": "read_file"' in service.rendered
    assert service.seen[-1].chat_request.tools_active


async def test_unknown_routes_answer_in_each_apis_shape(routed):
    _, _, app = routed
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://router") as http:
        r = await http.get("/v1/messages/count_tokens")
        assert r.status_code == 405 and r.json()["type"] == "error"
        r = await http.post("/v1/messages/batches", json={})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        r = await http.post("/v1/nowhere", json={})   # outside /v1/messages: OpenAI's shape, as before
        assert r.status_code == 404 and r.json()["error"]["message"] == "no route /v1/nowhere"
        r = await http.get("/v1/chat/completions")
        assert r.status_code == 405 and "not allowed" in r.json()["error"]["message"]
