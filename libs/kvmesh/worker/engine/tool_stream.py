"""Streamed tool-call deltas that add up to the final tool calls.

Why it exists: a chat stream with tools shows the model's tool calls as OpenAI ``tool_calls``
deltas while they are written (vLLM's streaming tool parsers, the sim's tool mode), and the final
output carries the calls parsed from the whole answer. Clients (the ``openai`` SDK's stream
accumulator, Anthropic's ``input_json_delta``) concatenate each call's pieces, so the pieces must
add up to the final calls. A streaming parser may leave the end of a call's arguments unsent
(vLLM's server appends ``get_remaining_unstreamed_args`` to its last delta) and gives calls other
ids than the final parse. The ledger records what was sent per call; ``completion`` makes the
final output's delta send the rest and gives the final calls the streamed ids.
"""

from __future__ import annotations

import logging

from kvmesh.worker.engine.base import ParsedDelta, ToolCall, ToolCallDelta

log = logging.getLogger(__name__)


class DeltaLedger:
    """What one answer's deltas have sent: the content and, per call index, id, name and arguments."""

    def __init__(self) -> None:
        self.content = ""
        self.reasoning = ""
        self.calls: dict[int, list[str]] = {}

    def record(self, delta: ParsedDelta) -> ParsedDelta:
        self.content += delta.content
        self.reasoning += delta.reasoning
        for d in delta.tool_calls:
            sent = self.calls.setdefault(d.index, ["", "", ""])
            sent[0] += d.id
            sent[1] += d.name
            sent[2] += d.arguments
        return delta

    def completion(self, calls: list[ToolCall], content: str | None, request_id: str = "",
                   reasoning: str | None = None) -> ParsedDelta:
        """The last delta: what of the final ``calls``, ``content`` and ``reasoning`` was not sent yet. A final call
        takes the id its deltas carried. If the deltas sent something the final calls do not start
        with (the streaming parser read the answer otherwise), the rest cannot be fixed up: logged."""
        out = ParsedDelta()
        for i, call in enumerate(calls):
            sent_id, sent_name, sent_args = self.calls.get(i, ("", "", ""))
            if sent_id and sent_id != call.id:
                call.id = sent_id
            rest = [want[len(have):] if want.startswith(have) else None
                    for have, want in ((sent_id, call.id), (sent_name, call.name), (sent_args, call.arguments))]
            if any(r is None for r in rest):
                log.warning("streamed tool-call deltas differ from the final parse",
                            extra={"request_id": request_id, "index": i, "tool": call.name})
                continue
            if any(rest):
                out.tool_calls.append(ToolCallDelta(i, *rest))   # type: ignore[arg-type]
        if len(self.calls) > len(calls):
            log.warning("a streamed tool call is not in the final parse",
                        extra={"request_id": request_id, "streamed": len(self.calls), "final": len(calls)})
        if content and content.startswith(self.content):
            out.content = content[len(self.content):]
        if reasoning and reasoning.startswith(self.reasoning):
            out.reasoning = reasoning[len(self.reasoning):]
        return self.record(out)


def merge(a: ParsedDelta, b: ParsedDelta) -> ParsedDelta:
    """``a`` then ``b`` as one delta (pieces of the same call joined)."""
    calls: dict[int, ToolCallDelta] = {}
    for d in (*a.tool_calls, *b.tool_calls):
        have = calls.get(d.index)
        if have is None:
            calls[d.index] = ToolCallDelta(d.index, d.id, d.name, d.arguments)
        else:
            have.id, have.name, have.arguments = have.id + d.id, have.name + d.name, have.arguments + d.arguments
    return ParsedDelta(a.content + b.content, list(calls.values()), a.reasoning + b.reasoning)
