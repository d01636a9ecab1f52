"""The Anthropic layer without a server: request conversion, stop sequences, and tool calls turned
into ``tool_use`` output, checked with the official ``anthropic`` client's own stream accumulator."""

from __future__ import annotations

import json

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.anthropic import responses as R
from kvmesh.anthropic.errors import AnthropicError
from kvmesh.anthropic.requests import parse_count_tokens, parse_messages
from kvmesh.anthropic.stops import StopMatcher
from kvmesh.anthropic.stream import MessageStream

H: dict[str, str] = {}


def _req(**over):
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    body.update(over)
    return parse_messages(body, H)


def test_system_blocks_join_and_skip_the_billing_header():
    req = _req(system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc"},
                       {"type": "text", "text": "You are "}, {"type": "text", "text": "an agent.",
                                                               "cache_control": {"type": "ephemeral"}}])
    assert req.messages[0] == {"role": "system", "content": "You are an agent."}


def test_tool_use_and_tool_result_become_openai_turns():
    req = _req(messages=[
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                          {"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {"d": "."}},
                                          {"type": "tool_use", "id": "toolu_2", "name": "ls", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                                     {"type": "tool_result", "tool_use_id": "toolu_2", "content": "c",
                                      "is_error": True}]},
        {"role": "user", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "one"},
                                     {"type": "text", "text": "two"}]},
    ], tools=[{"name": "ls", "input_schema": {"properties": {}}}])
    assert req.messages == [
        {"role": "user", "content": "list files"},
        {"role": "assistant", "reasoning": "hmm", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "ls", "arguments": '{"d": "."}'}},
            {"id": "toolu_2", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a\nb"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "c"},
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
    ]
    assert req.tools == [{"type": "function", "function": {
        "name": "ls", "description": None, "parameters": {"properties": {}, "type": "object"}}}]
    assert req.tool_choice == "auto"


@pytest.mark.parametrize("choice,expected", [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "ls"}, {"type": "function", "function": {"name": "ls"}}),
])
def test_tool_choice_maps_to_openai(choice, expected):
    req = _req(tools=[{"name": "ls", "input_schema": {"type": "object"}}], tool_choice=choice)
    assert req.tool_choice == expected


def test_session_from_header_else_metadata_user_id():
    assert _req(metadata={"user_id": "u1"}).session_id == "u1"
    assert parse_messages({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                           "metadata": {"user_id": "u1"}}, {"x-session-id": "s9"}).session_id == "s9"


@pytest.mark.parametrize("over,field", [
    ({"max_tokens": None}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "n"}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {}}]}]}]}, "messages.0.content.0.content.0"),
    ({"tools": [{"name": "bad name!", "input_schema": {}}]}, "tools.0.name"),
    ({"tool_choice": {"type": "tool", "name": "x"}, "tools": [{"name": "y", "input_schema": {}}]},
     "tool_choice.name"),
    ({"top_p": 0}, "top_p"), ({"stop_sequences": [""]}, "stop_sequences"),
    ({"stop_sequences": ["s"] * 17}, "stop_sequences"), ({"speed": "fast"}, "speed"),
    ({"output_config": {"format": {}}}, "output_config.format.type"),
    ({"output_config": {"effort": "turbo"}}, "output_config.effort"),
    ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}, "context_management.edits.0"),
    ({"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns",
                                                                                  "value": 1}}]}},
     "context_management.edits.0"), ({"metadata": {"x": 1}}, "metadata.x"),
])
def test_bad_fields_are_named(over, field):
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **over}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(AnthropicError) as err:
        parse_messages(body, H)
    assert err.value.status == 400 and err.value.message.startswith(field + ":")
    assert err.value.body()["type"] == "error" and err.value.body()["error"]["type"] == "invalid_request_error"


def test_count_tokens_takes_no_max_tokens_and_refuses_sampling_fields():
    assert parse_count_tokens({"model": "m", "messages": [{"role": "user", "content": "x"}]}, H).max_tokens is None
    with pytest.raises(AnthropicError):
        parse_count_tokens({"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]}, H)


def test_stop_matcher_holds_back_and_finds_the_earliest():
    m = StopMatcher(["END", "ZZ"])
    out = m.push("abc E") + m.push("N") + m.push("D more")
    assert out == "abc " and m.matched == "END" and m.push("x") == "" and m.flush() == ""
    m = StopMatcher(["ZZ", "bZ"])
    assert m.push("aab") == "aa" and m.push("ZZ") == "" and m.matched == "bZ"
    m = StopMatcher(["END"])
    assert m.push("the EN") == "the " and m.flush() == "EN" and m.matched is None


@given(st.text(alphabet="abE ND", max_size=40), st.lists(st.integers(1, 5), max_size=20))
def test_stop_matcher_equals_a_search_of_the_whole_text(text, cuts):
    stops = ["END", "aa"]
    m = StopMatcher(stops)
    out, i = "", 0
    for c in [*cuts, len(text)]:
        out += m.push(text[i:i + c])
        i += c
    out += m.flush()
    hits = [(text.find(s), s) for s in stops if s in text]
    if hits:
        pos, s = min(hits)
        assert (out, m.matched) == (text[:pos], s)
    else:
        assert (out, m.matched) == (text, None)


def _replay(events: list[bytes]):
    """Feed our SSE events to the official client's accumulator; returns the event names and the message."""
    snap, names = None, []
    for raw in events:
        head, data = raw.decode().rstrip("\n").split("\n")
        doc = json.loads(data.removeprefix("data: "))
        names.append(head.removeprefix("event: "))
        assert doc["type"] == names[-1]
        if names[-1] != "ping":
            snap = accumulate_event(event=doc, current_snapshot=snap, json_bufs={})
    return names, snap


# The engine's tool calls in OpenAI's shape, as the router's final report will carry them.
CALLS = [{"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}},
         {"id": "", "type": "function", "function": {"name": "ls", "arguments": ""}}]


def test_tool_calls_stream_as_tool_use_blocks():
    calls = R.tool_calls_from(CALLS)   # a constructed result: the router returns no tool calls yet
    assert [(c.name, c.arguments) for c in calls] == [("read_file", '{"path": "a.py"}'), ("ls", "")]
    ms = MessageStream("msg_1", "m")
    events = ms.start(R.usage(100, 0, 64)) + ms.text("Reading.")
    for c in calls:
        events += ms.tool_use(c)
    stop = R.stop_reason("stop", None, tool_use=True)
    events += ms.finish(stop, R.usage(100, 12, 64))
    names, msg = _replay(events)
    assert names == ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_stop", "message_delta", "message_stop"]
    assert [b.type for b in msg.content] == ["text", "tool_use", "tool_use"]
    assert msg.content[0].text == "Reading."
    assert (msg.content[1].id, msg.content[1].name, msg.content[1].input) == ("call_1", "read_file", {"path": "a.py"})
    assert msg.content[2].id.startswith("toolu_") and msg.content[2].input == {}
    assert msg.stop_reason == "tool_use" and msg.usage.output_tokens == 12
    assert (msg.usage.input_tokens, msg.usage.cache_read_input_tokens) == (36, 64)


def test_tool_calls_in_the_complete_message_and_a_cut_short_call_stays_text():
    blocks = R.content_blocks("", R.tool_calls_from([{"id": "c", "name": "f", "arguments": {"x": 1}}]))
    assert blocks == [{"type": "tool_use", "id": "c", "name": "f", "input": {"x": 1}}]
    cut = R.tool_calls_from([{"id": "c", "function": {"name": "f", "arguments": '{"x": '}}])
    assert R.content_blocks("ok ", cut) == [{"type": "text", "text": 'ok {"x": '}]
    names, msg = _replay(MessageStream("m1", "m").start(R.usage(5, 0, 0)) + MessageStream("m1", "m").finish(
        R.stop_reason("stop", None, False), R.usage(5, 0, 0)))
    assert msg.content[0].type == "text" and msg.content[0].text == "" and msg.stop_reason == "end_turn"


@pytest.mark.parametrize("finish,stop,tool,expected", [
    ("length", None, False, ("max_tokens", None)), ("stop", None, False, ("end_turn", None)),
    ("stop", "END", False, ("stop_sequence", "END")), ("stop", None, True, ("tool_use", None)),
    ("length", None, True, ("max_tokens", None)),
])
def test_stop_reasons(finish, stop, tool, expected):
    assert R.stop_reason(finish, stop, tool) == expected


def test_claude_code_2_1_197_turn_is_served() -> None:
    """What Claude Code 2.1.197 sends every turn: adaptive thinking (vLLM pins nothing), a context edit
    that keeps every thinking block, and an effort, which vLLM renders as the template keyword
    ``reasoning_effort`` (a template that does not read it never sees it)."""
    body = {"model": "m", "max_tokens": 32000, "messages": [{"role": "user", "content": "hi"}],
            "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "metadata": {"user_id": '{"device_id":"d","account_uuid":"","session_id":"s-1"}'}, "stream": True}
    req = parse_messages(body, H)
    assert req.template_kwargs == {"reasoning_effort": "high"} and req.structured_outputs is None
    assert req.session_id == body["metadata"]["user_id"]
    assert parse_messages({**body, "output_config": None}, H).template_kwargs == {}


def test_thinking_disabled_renders_as_vllm_chooses() -> None:
    """vLLM's /v1/messages renders ``thinking: disabled`` as effort ``"none"`` where the template
    reads it, and ``"low"`` where ``"none"`` renders like a thinking effort or fails to render."""
    from kvmesh.anthropic.requests import disabled_thinking_effort

    assert disabled_thinking_effort(lambda kw: "same prompt") == "low"
    assert disabled_thinking_effort(lambda kw: f"thinking={kw['enable_thinking']}") == "none"

    def refuses_none(kw):
        if kw["reasoning_effort"] == "none":
            raise ValueError("unknown effort")
        return kw["reasoning_effort"]

    assert disabled_thinking_effort(refuses_none) == "low"
    req = parse_messages({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                          "thinking": {"type": "disabled"}}, {})
    assert req.thinking_disabled and req.template_kwargs == {}
