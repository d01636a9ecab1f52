"""Tool calls out of a vLLM engine's answer, parsed by vLLM's own tool parsers.

Why it exists: a chat answer that calls tools is text in the model's own format (Hermes
``<tool_call>{...}</tool_call>``, Llama JSON, Mistral ``[TOOL_CALLS]``...). vLLM's OpenAI server
turns it into ``tool_calls`` with the parser named by ``--tool-call-parser``; the kvmesh worker
runs the engine in-process and the router gets token ids, so the worker does the same, with the
same parsers (``vllm.tool_parsers.ToolParserManager``): while the answer streams with the parser's
``extract_tool_calls_streaming`` (``VllmToolStream``, deltas as vLLM's server streams them), and on
the finished answer with ``extract_tool_calls``. It applies
vLLM's rules for which requests may ask for tools: ``tool_choice="auto"`` needs
``enable_auto_tool_choice`` and a parser, ``"required"`` or a named tool a parser. Imported only
where vLLM is installed.
"""

from __future__ import annotations

import logging
from typing import Any

from kvmesh.worker.engine.base import EngineRequest, InvalidRequestError, ParsedDelta, ToolCall, ToolCallDelta
from kvmesh.worker.engine.tool_stream import DeltaLedger, merge

log = logging.getLogger(__name__)


class VllmToolCalls:
    """One parser class for the engine; a parser object per request (parsers keep state)."""

    def __init__(self, parser_name: str, tokenizer: Any, enable_auto_tool_choice: bool) -> None:
        from vllm.tool_parsers import ToolParserManager

        self.parser_name = parser_name
        self.parser_cls = ToolParserManager.get_tool_parser(parser_name) if parser_name else None
        self.tokenizer = tokenizer
        self.enable_auto = enable_auto_tool_choice

    def check(self, req: EngineRequest) -> None:
        """vLLM's refusals of a request with tools this engine cannot parse (a 400)."""
        if not req.tools or req.tool_choice in (None, "none"):
            return
        if req.tool_choice == "auto" and not (self.enable_auto and self.parser_cls is not None):
            raise InvalidRequestError('"auto" tool choice requires --enable-auto-tool-choice and '
                                      "--tool-call-parser to be set on the worker")
        if self.parser_cls is None:
            raise InvalidRequestError(f"tool_choice={req.tool_choice!r} requires --tool-call-parser to be set "
                                      "on the worker")

    def active(self, req: EngineRequest) -> bool:
        return self.parser_cls is not None and bool(req.tools) and req.tool_choice not in (None, "none")

    def parser(self, req: EngineRequest) -> tuple[Any, Any]:
        """A fresh parser for ``req`` and vLLM's chat request as the parser adjusted it."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest(model="kvmesh", messages=[{"role": "user", "content": ""}],
                                        tools=req.tools, tool_choice=req.tool_choice)
        parser = self.parser_cls(self.tokenizer, request.tools)
        try:
            request = parser.adjust_request(request)
        except Exception:  # a parser that cannot adjust this request still parses the text
            log.debug("tool parser adjust_request failed", exc_info=True)
        return parser, request

    def stream(self, req: EngineRequest) -> VllmToolStream | None:
        """The streaming parse of ``req``'s answer; None when tools may not be called."""
        return VllmToolStream(self, req) if self.active(req) else None

    def parse(self, req: EngineRequest, output_ids: list[int]) -> tuple[list[ToolCall], str] | None:
        """The calls and the remaining text of a finished answer; None when it called no tool."""
        if not self.active(req):
            return None
        parser, request = self.parser(req)
        text = self.tokenizer.decode(output_ids, skip_special_tokens=bool(request.skip_special_tokens))
        info = parser.extract_tool_calls(text, request)
        if not info.tools_called or not info.tool_calls:
            return None
        calls = [ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments or "{}")
                 for c in info.tool_calls]
        return calls, info.content or ""


class VllmToolStream:
    """One answer through vLLM's streaming tool parser, an engine output at a time, as vLLM's
    OpenAI server feeds it (previous/current text and token ids, and the delta of each). Text is
    decoded in full each time (answers are short next to prompts); an output whose text ends in
    an incomplete character waits for the next. A parser that fails stops streaming: ``finish``
    then sends the whole answer, as parsed at the end."""

    def __init__(self, owner: VllmToolCalls, req: EngineRequest) -> None:
        self.owner = owner
        self.req = req
        self.parser, self.request = owner.parser(req)
        self.skip_special = bool(self.request.skip_special_tokens)
        self.ids: list[int] = []
        self.parsed_ids: list[int] = []
        self.text = ""
        self.broken = False
        self.ledger = DeltaLedger()

    def push(self, new_ids: list[int]) -> ParsedDelta:
        self.ids.extend(new_ids)
        if self.broken or not new_ids:
            return ParsedDelta()
        text = self.owner.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special)
        if text.endswith("\ufffd") or not text.startswith(self.text):
            return ParsedDelta()
        try:
            dm = self.parser.extract_tool_calls_streaming(
                previous_text=self.text, current_text=text, delta_text=text[len(self.text):],
                previous_token_ids=list(self.parsed_ids), current_token_ids=list(self.ids),
                delta_token_ids=self.ids[len(self.parsed_ids):], request=self.request)
        except Exception:   # vLLM's server ends the stream here; we fall back to the final parse
            log.warning("streaming tool parser failed; the answer is sent when finished", exc_info=True,
                        extra={"request_id": self.req.request_id})
            self.broken = True
            return ParsedDelta()
        self.text, self.parsed_ids = text, list(self.ids)
        return self.ledger.record(_delta(dm))

    def finish(self, new_ids: list[int]) -> tuple[ParsedDelta, tuple[list[ToolCall], str] | None]:
        """The last output's delta (its tokens, then what the deltas have not sent of the final parse)
        and the final parse (None: no tool call)."""
        last = self.push(new_ids)
        parsed = self.owner.parse(self.req, self.ids)
        if parsed is not None:
            rest = self.ledger.completion(parsed[0], parsed[1], self.req.request_id)
        else:
            text = self.owner.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special)
            rest = self.ledger.completion([], text, self.req.request_id)
        return merge(last, rest), parsed


def _delta(dm: Any) -> ParsedDelta:
    """vLLM's ``DeltaMessage`` as a ``ParsedDelta`` (None: nothing new)."""
    if dm is None:
        return ParsedDelta()
    calls = [ToolCallDelta(tc.index, tc.id or "", (tc.function.name or "") if tc.function else "",
                           (tc.function.arguments or "") if tc.function else "") for tc in dm.tool_calls or []]
    return ParsedDelta(dm.content or "", calls)
