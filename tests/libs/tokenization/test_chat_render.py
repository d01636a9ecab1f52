"""The chat renderer without vLLM: the router's and the worker's paths agree, vLLM's conversation rules
hold, bad requests are refused naming the field, the sim's tool arguments fit their schemas."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest

from kvmesh.openai.requests import parse_chat
from kvmesh.tokenization import load_tokenizer
from kvmesh.tokenization.chat_render import (
    ChatRenderer,
    ChatRenderError,
    chat_request_from_body,
    conversation,
)
from kvmesh.worker.engine.sim.tool_calls import example_value, sim_tool_call
from kvmesh.worker.http_api import prompt_ids
from tests.helpers.chat_cases import TOOLS, make_case

pytestmark = pytest.mark.timeout(300)


def test_router_and_worker_paths_give_the_same_ids(tiny_model_dir: Path) -> None:
    """Router: template source + fast tokenizer (``ChatTokenizer.render``); worker HTTP API: a
    transformers tokenizer (``prompt_ids``). 60 varied requests, tools and tool results included."""
    from transformers import AutoTokenizer

    router_tok = load_tokenizer(tiny_model_dir)
    hf = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    worker = ChatRenderer(hf_tokenizer=hf)
    for i in range(60):
        body = make_case(i, kwargs_keys={"add_generation_prompt": [False]})
        req = parse_chat(body, {})
        assert req.chat_request is not None
        ours = router_tok.encode(router_tok.render(req.chat_request))
        assert ours == prompt_ids(req, hf, worker), f"case {i}"


def test_conversation_follows_vllm_rules() -> None:
    msgs = [{"role": "system", "content": "x-anthropic-billing-header: cch=1\nBe brief."},
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}],
             "extra_key": 1},
            {"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "id": "c1", "function": {"name": "f", "arguments": "[1]"}},
                {"type": "function", "id": "c2", "function": {"name": "g", "arguments": '{"k": 1}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "r1"},
                                                               {"type": "text", "text": "r2"}]}]
    conv = conversation(msgs, "string", template="no developer role here")
    assert conv[0] == {"role": "system", "content": "Be brief.\n\nUse tools."}
    assert conv[1] == {"role": "user", "content": "a\nb"}
    assert conv[2]["tool_calls"] == [
        {"id": "c1", "function": {"arguments": {}, "name": "f"}, "type": "function"},
        {"id": "c2", "function": {"arguments": {"k": 1}, "name": "g"}, "type": "function"}]
    assert conv[3] == {"role": "tool", "content": "r1\nr2", "tool_call_id": "c1"}
    assert msgs[3]["tool_calls"][1]["function"]["arguments"] == '{"k": 1}'   # the input is not modified
    parts = conversation(msgs[2:3], "openai")
    assert parts[0]["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web"}]}, "tools[0].type"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "tool_choice": "maybe"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
      "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": []}, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "x"}], "documents": "doc"}, "documents"),
    ({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "yes"}, "add_generation_prompt"),
])
def test_bad_requests_name_the_field(body, param) -> None:
    with pytest.raises(ChatRenderError) as ei:
        chat_request_from_body(body)
    assert ei.value.param == param


def test_template_keywords_are_checked(tiny_model_dir: Path) -> None:
    r = ChatRenderer(tiny_model_dir)
    base = {"messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(ChatRenderError) as ei:
        r.render_ids(chat_request_from_body({**base, "chat_template_kwargs": {"enable_thinking": False}}))
    assert ei.value.param == "chat_template_kwargs.enable_thinking"
    # A keyword the template reads is passed, under the request's own flags (vLLM's merge).
    plain = r.render_text(chat_request_from_body(base))
    kw = r.render_text(chat_request_from_body({**base, "chat_template_kwargs": {"add_generation_prompt": False}}))
    assert kw == plain and plain.endswith("assistant\n")


@pytest.mark.parametrize("tool", TOOLS, ids=[t["function"]["name"] for t in TOOLS])
def test_sim_tool_arguments_fit_the_schema(tool) -> None:
    import json

    schema = tool["function"].get("parameters") or {"type": "object"}
    jsonschema.validate(example_value(schema), schema)
    call = sim_tool_call("req-1", [tool], "auto")
    assert call is not None and call.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.arguments), schema)
    assert call == sim_tool_call("req-1", [tool], "required")   # deterministic per request
    assert sim_tool_call("req-1", [tool], "none") is None


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    from kvmesh.openai.responses import tool_calls
    from kvmesh.worker.engine.base import ToolCall

    calls = [ToolCall("c1", "f", "{}"), ToolCall("c2", "g", '{"a": 1}')]
    req = chat_request_from_body({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                                  "parallel_tool_calls": False})
    assert [c["id"] for c in tool_calls(calls, req.parallel_tool_calls)] == ["c1"]
    assert tool_calls(calls)[1] == {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"a": 1}'}}
