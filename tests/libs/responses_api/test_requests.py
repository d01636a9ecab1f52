"""The Responses request layer: items to chat messages (vLLM's merge rules), tools and tool_choice, the
session hint, what is refused and how each refusal names its field, and the answer and event builders."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvmesh.openai.errors import BadRequest
from kvmesh.responses_api.output import ResponseHead, output_items, usage
from kvmesh.responses_api.requests import parse_responses
from kvmesh.responses_api.stream import ResponseEvents
from tests.libs.responses_api.cases import BODIES, CODEX_TURNS, TOOLS


def _parse(body: dict[str, Any], headers: dict[str, str] | None = None, **kw: Any):
    return parse_responses({"model": "m", **json.loads(json.dumps(body))}, headers or {}, **kw)


def test_codex_history_becomes_the_chat_conversation() -> None:
    req = _parse({"instructions": "You are Codex.", "input": CODEX_TURNS, "tools": TOOLS})
    msgs = req.chat.messages
    assert [m["role"] for m in msgs] == ["system", "developer", "user", "user", "assistant", "tool", "tool",
                                         "assistant", "tool", "assistant", "user"]
    # reasoning, the assistant's text and its two calls are one assistant message, as vLLM merges them
    a = msgs[4]
    assert (a["reasoning"], a["content"]) == ("Look first.", "Reading a.py.")
    assert [c["id"] for c in a["tool_calls"]] == ["call_1", "call_2"]
    assert msgs[5] == {"role": "tool", "tool_call_id": "call_1", "content": "def f():\n    return 1/0\n"}
    # a call after tool outputs starts a new assistant message; text after the next tool output, another
    assert msgs[7] == {"role": "assistant", "tool_calls": [
        {"id": "call_3", "type": "function", "function": {"name": "read_file", "arguments": "not json"}}]}
    assert msgs[9] == {"role": "assistant", "content": "Fixed."}
    assert req.chat.chat_request.tools[0] == {"type": "function", "function": {
        "name": "shell", "description": "Run a command.", "parameters": TOOLS[0]["parameters"], "strict": False}}
    assert req.tools == TOOLS and req.instructions == "You are Codex."


@pytest.mark.parametrize("i", range(len(BODIES)))
def test_every_case_renders(i, tiny_model_dir) -> None:
    """The cases vLLM's conversion is compared on (vLLM tier) render here too."""
    from kvmesh.tokenization import load_tokenizer

    req = _parse(BODIES[i]).chat.chat_request
    assert load_tokenizer(tiny_model_dir).render(req)


def test_tool_choice_and_sampling_map_to_chat() -> None:
    req = _parse({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "shell"},
                  "max_output_tokens": 7, "temperature": 0.2, "top_p": 0.9, "top_k": 20, "parallel_tool_calls": False})
    c = req.chat
    assert c.chat_request.tool_choice == {"type": "function", "function": {"name": "shell"}}
    assert (c.max_tokens, c.temperature, c.top_p, c.knobs["top_k"]) == (7, 0.2, 0.9, 20)
    assert c.chat_request.parallel_tool_calls is False and req.tool_choice == {"type": "function", "name": "shell"}


@pytest.mark.parametrize("body,headers,session", [
    ({"prompt_cache_key": "k", "user": "u"}, {"x-session-id": "h"}, "k"),
    ({"user": "u"}, {"x-session-id": "h"}, "h"),
    ({"user": "u"}, {}, "u"),
    ({"session_id": "s", "user": "u"}, {}, "s"),
])
def test_session_hint(body, headers, session) -> None:
    assert _parse({"input": "hi", **body}, headers).chat.session_id == session


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "hi", "tools": [{"type": "telepathy"}]}, "tools[0]"),
    ({"input": "hi", "tools": [{"type": "namespace", "name": "ns"}]}, "tools[0]"),
    ({"input": "hi", "tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "function"}]}]},
     "tools[0].tools[0]"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "namespace": 3}]},
     "input[0]"),
    ({"input": "hi", "tools": [{"type": "custom"}]}, "tools[0]"),
    ({"input": "hi", "tools": [{"type": "custom", "name": "apply_patch",   # vLLM refuses a grammar too
                               "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}]},
     "tools[0]"),
    ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "apply_patch", "input": 5}]}, "input[0]"),
    ({"input": "hi", "tools": "x"}, "tools"),
    ({"input": "hi", "tools": [{"type": "function"}]}, "tools[0]"),
    ({"input": "hi", "tools": [{"type": "function", "name": ""}]}, "tools[0]"),
    ({"input": "hi", "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),   # needs tools, as in chat
    ({"input": [{"type": "function_call", "call_id": 1, "name": "f", "arguments": "{}"}]}, "input[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input[0]"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0]"),
    ({"input": [{"role": "user", "content": 5}]}, "input[0]"),
    ({"input": ["hi"]}, "input[0]"),
    ({"input": "hi", "instructions": 3}, "instructions"),
    ({"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "hi", "max_output_tokens": 2**40}, "max_output_tokens"),
    ({"input": "hi", "user": 5}, "user"),
])
def test_refusals_name_their_field(body, param) -> None:
    with pytest.raises(BadRequest) as e:
        _parse(body)
    assert e.value.param == param and e.value.status == 400


def test_what_an_engine_with_its_own_responses_api_honours_is_left_to_it() -> None:
    body = {"input": "hi", "text": {"format": {"type": "json_object"}}, "top_logprobs": 3, "truncation": "auto",
            "include": ["message.output_text.logprobs"], "reasoning": {"effort": "low"}}
    with pytest.raises(BadRequest):
        _parse(body)
    req = _parse(body, engine_renders=True)
    assert req.chat.chat_request.engine_kwargs == {"reasoning_effort": "low", "enable_thinking": True}
    own = _parse({**body, "chat_template_kwargs": {"enable_thinking": False}}, engine_renders=True)
    assert own.chat.chat_request.engine_kwargs == {"reasoning_effort": "low"}
    with pytest.raises(BadRequest):   # server state is refused whoever renders
        _parse({**body, "previous_response_id": "resp_1"}, engine_renders=True)


def test_neutral_values_are_accepted() -> None:
    _parse({"input": "hi", "store": True, "background": False, "top_logprobs": 0, "truncation": "disabled",
            "text": {"format": {"type": "text"}, "verbosity": "medium"}, "reasoning": {"summary": None},
            "include": ["reasoning.encrypted_content"], "service_tier": "auto", "metadata": {"a": "b"},
            "previous_response_id": None, "stream_options": {"include_obfuscation": False}})


class _C:
    def __init__(self, i: int) -> None:
        self.id, self.name, self.arguments = f"call_{i}", "shell", '{"command": ["ls"]}'


def test_events_open_and_close_items_in_order() -> None:
    req = _parse({"input": "hi", "tools": TOOLS})
    ev = ResponseEvents(ResponseHead(req, "m"))
    raw = ev.start() + ev.text("Let ") + ev.text("me.") + ev.call_delta(0, "call_0", "shell", '{"comm')
    raw += ev.call_delta(0, "", "", 'and": []}') + ev.call(*vars(_C(1)).values()) + ev.call(*vars(_C(2)).values())
    raw += ev.finish(False, {"input_tokens": 1})
    events = [json.loads(block.split(b"\ndata: ", 1)[1]) for block in raw.strip().split(b"\n\n")]
    kinds = [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 4
    final = events[-1]["response"]
    assert final["status"] == "completed"
    assert [o["type"] for o in final["output"]] == ["message", "function_call", "function_call", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Let me."
    assert final["output"][1]["arguments"] == '{"command": []}'
    assert [o["call_id"] for o in final["output"][1:]] == ["call_0", "call_1", "call_2"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == final["output"]


def test_a_whole_answer_without_text_has_only_its_calls() -> None:
    items = output_items("", [_C(0)], _parse({"input": "hi"}))
    assert [i["type"] for i in items] == ["function_call"] and items[0]["status"] == "completed"


PATCH_TOOL = {"type": "custom", "name": "apply_patch", "description": "Apply a patch.", "format": {"type": "text"}}


def test_custom_tools_are_vllms_one_string_shim() -> None:
    """A freeform tool is shown as a function of one string ``input``; its calls and outputs in the
    history are that function's calls and tool messages; a named choice of it names the function."""
    hist = [{"role": "user", "content": "Fix it."},
            {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin Patch\n\"ü\""},
            {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done!"}]
    req = _parse({"input": hist, "tools": [PATCH_TOOL, TOOLS[0]], "tool_choice": {"type": "custom", "name": "apply_patch"}})
    tool = req.chat.chat_request.tools[0]["function"]
    assert tool["name"] == "apply_patch" and tool["parameters"]["required"] == ["input"]
    call = req.chat.messages[1]["tool_calls"][0]["function"]
    assert json.loads(call["arguments"]) == {"input": "*** Begin Patch\n\"ü\""} and "ü" in call["arguments"]
    assert req.chat.messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "Done!"}
    assert req.chat.chat_request.tool_choice == {"type": "function", "function": {"name": "apply_patch"}}
    assert req.custom_tools == {"apply_patch"}


class _Named:
    def __init__(self, name: str, arguments: str) -> None:
        self.id, self.name, self.arguments = "call_9", name, arguments


def test_a_custom_tools_call_comes_back_as_its_input() -> None:
    req = _parse({"input": "hi", "tools": [PATCH_TOOL]})
    items = output_items("", [_Named("apply_patch", json.dumps({"input": "*** Begin Patch"})), _Named("shell", "{}")],
                         req)
    assert items[0] == {**items[0], "type": "custom_tool_call", "call_id": "call_9", "input": "*** Begin Patch"}
    assert items[0]["id"].startswith("ctc_") and items[1]["type"] == "function_call"
    # Arguments that are not the shim's JSON pass through as the input, as vLLM's do.
    assert output_items("", [_Named("apply_patch", "raw text")], req)[0]["input"] == "raw text"


def test_a_streamed_custom_call_sends_its_input_whole() -> None:
    req = _parse({"input": "hi", "tools": [PATCH_TOOL]})
    ev = ResponseEvents(ResponseHead(req, "m"))
    raw = ev.start() + ev.call_delta(0, "call_1", "apply_patch", '{"inp') + ev.call_delta(0, "", "", 'ut": "x\\ny"}')
    raw += ev.finish(False, {})
    events = [json.loads(block.split(b"\ndata: ", 1)[1]) for block in raw.strip().split(b"\n\n")]
    kinds = [e["type"] for e in events]
    assert "response.function_call_arguments.delta" not in kinds
    [delta] = [e for e in events if e["type"] == "response.custom_tool_call_input.delta"]
    assert delta["delta"] == "x\ny"
    added = next(e for e in events if e["type"] == "response.output_item.added")["item"]
    assert added["type"] == "custom_tool_call" and added["input"] == "" and "arguments" not in added
    final = events[-1]["response"]["output"]
    assert final == [{"type": "custom_tool_call", "id": added["id"], "call_id": "call_1", "name": "apply_patch",
                      "input": "x\ny"}]


# Codex 0.171 sends its sub-agent tools as a namespace, and OpenAI's hosted web search, on every turn.
AGENTS = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [
    {"type": "function", "name": "spawn_agent", "description": "Spawn one.", "strict": False,
     "parameters": {"type": "object", "properties": {"task": {"type": "string"}}, "required": ["task"]}},
    {"type": "function", "name": "close_agent", "parameters": {"type": "object", "properties": {}}}]}
WEB = {"type": "web_search", "external_web_access": False}


def test_namespace_tools_are_flattened_and_hosted_tools_left_out_as_vllm_does() -> None:
    """vLLM's ``get_function_tools``: a namespace's functions in request order, named
    ``<namespace>__<name>``; hosted tools are never shown to the model. A call of a namespace's
    function in the history is rendered under its flat name, and an answer's call comes back with
    its own name and its ``namespace``; a named ``tool_choice`` finds a namespace's function by its
    own name when only one namespace has it."""
    hist = [{"role": "user", "content": "Split the work."},
            {"type": "function_call", "call_id": "c1", "name": "spawn_agent", "namespace": "multi_agent_v1",
             "arguments": '{"task": "tests"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "agent 7"}]
    req = _parse({"input": hist, "tools": [TOOLS[0], AGENTS, WEB], "tool_choice": {"type": "function",
                                                                                  "name": "close_agent"}})
    names = [t["function"]["name"] for t in req.chat.chat_request.tools]
    assert names == [TOOLS[0]["name"], "multi_agent_v1__spawn_agent", "multi_agent_v1__close_agent"]
    assert req.chat.messages[1]["tool_calls"][0]["function"]["name"] == "multi_agent_v1__spawn_agent"
    assert req.chat.chat_request.tool_choice == {"type": "function", "function": {"name": "multi_agent_v1__close_agent"}}
    [item] = output_items("", [_Named("multi_agent_v1__close_agent", "{}")], req)
    assert (item["name"], item["namespace"]) == ("close_agent", "multi_agent_v1")
    assert "namespace" not in output_items("", [_Named(TOOLS[0]["name"], "{}")], req)[0]
    only_hosted = _parse({"input": "hi", "tools": [WEB, {"type": "file_search", "vector_store_ids": ["v"]}]})
    assert not only_hosted.chat.chat_request.tools
    twice = {**AGENTS, "name": "other"}
    with pytest.raises(BadRequest, match="ambiguous"):
        _parse({"input": "hi", "tools": [AGENTS, twice], "tool_choice": {"type": "function", "name": "close_agent"}})


def test_a_streamed_namespace_call_carries_its_namespace() -> None:
    req = _parse({"input": "hi", "tools": [AGENTS]})
    ev = ResponseEvents(ResponseHead(req, "tiny"))
    raw = ev.start() + ev.call_delta(0, "call_1", "multi_agent_v1__spawn_agent", '{"task": "x"}')
    raw += ev.finish(False, usage(3, 2, 0))
    events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]
    added = next(e["item"] for e in events if e["type"] == "response.output_item.added")
    done = next(e["item"] for e in events if e["type"] == "response.output_item.done")
    assert (added["name"], added["namespace"]) == (done["name"], done["namespace"]) == ("spawn_agent", "multi_agent_v1")
    assert next(e for e in events if e["type"] == "response.completed")["response"]["output"] == [done]
