"""Streamed tool-call deltas add up to the final calls: the ledger's completion and the sim's tool mode."""

from __future__ import annotations

import json

from kvmesh.worker.engine.base import ParsedDelta, ToolCall, ToolCallDelta
from kvmesh.worker.engine.sim.tool_calls import SimToolStream, sim_tool_call
from kvmesh.worker.engine.tool_stream import DeltaLedger, merge
from tests.helpers.chat_cases import TOOLS


def _rebuild(deltas: list[ParsedDelta]) -> tuple[str, dict[int, list[str]]]:
    content, calls = "", {}
    for d in deltas:
        content += d.content
        for c in d.tool_calls:
            have = calls.setdefault(c.index, ["", "", ""])
            have[0], have[1], have[2] = have[0] + c.id, have[1] + c.name, have[2] + c.arguments
    return content, calls


def test_completion_sends_what_the_parser_left_and_keeps_the_streamed_ids() -> None:
    ledger = DeltaLedger()
    sent = [ledger.record(ParsedDelta("Let me ", [])),
            ledger.record(ParsedDelta("", [ToolCallDelta(0, "stream-id", "get_weather", '{"loc')]))]
    final = [ToolCall("final-id", "get_weather", '{"location": "Paris"}'), ToolCall("c2", "edit", "{}")]
    last = ledger.completion(final, "Let me check.")
    content, calls = _rebuild([*sent, last])
    assert content == "Let me check."
    assert final[0].id == "stream-id"     # the final calls take the ids the client already has
    assert calls == {0: ["stream-id", "get_weather", '{"location": "Paris"}'], 1: ["c2", "edit", "{}"]}


def test_deltas_that_contradict_the_final_parse_are_not_patched() -> None:
    ledger = DeltaLedger()
    ledger.record(ParsedDelta("", [ToolCallDelta(0, "i", "get_weather", '{"x": 1')]))
    last = ledger.completion([ToolCall("i", "get_weather", '{"location": "Paris"}')], None)
    assert last.tool_calls == []          # nothing sensible to append: logged, not corrupted further


def test_merge_joins_pieces_of_one_call() -> None:
    m = merge(ParsedDelta("a", [ToolCallDelta(0, "i", "n", "{")]), ParsedDelta("b", [ToolCallDelta(0, "", "", "}"),
                                                                                   ToolCallDelta(1, "j", "m", "")]))
    assert m.content == "ab" and m.tool_calls == [ToolCallDelta(0, "i", "n", "{}"), ToolCallDelta(1, "j", "m", "")]


def test_sim_tool_mode_streams_its_call_in_pieces() -> None:
    for outputs in (0, 1, 2, 5, 40):
        call = sim_tool_call("req-1", TOOLS, "auto")
        assert call is not None
        stream = SimToolStream(ToolCall(call.id, call.name, call.arguments))
        deltas = [stream.next() for _ in range(outputs)] + [stream.finish("req-1")]
        content, calls = _rebuild(deltas)
        assert content == "" and calls == {0: [call.id, call.name, call.arguments]}
        json.loads(calls[0][2])
        if outputs >= 2:
            assert sum(bool(d.tool_calls) for d in deltas) >= 2
