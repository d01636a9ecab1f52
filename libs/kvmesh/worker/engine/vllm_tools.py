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

``"required"`` and a named tool force a call: vLLM's server constrains the output with structured
outputs (a structural tag in the parser's own format, e.g. hermes ``<tool_call>`` blocks, or for
parsers without one a JSON schema of the calls), made by its unified parser's ``adjust_request``
(``vllm.parser.ParserManager``). ``structured_outputs`` gives the engine the same constraint, and
``parse`` reads a forced answer with that parser's ``parse``, as vLLM's server does, so even a model
that would never call a tool (dummy weights) answers with a real call.

``parallel_tool_calls`` false (``EngineRequest.parallel_tool_calls``) is handled as vLLM's server
handles it: the unified parser's ``adjust_request`` builds the call grammar with its list stopped
after the first call (for ``"auto"`` too, where the parser has a structural tag), and only the first
call is returned, streamed deltas of other calls dropped (``maybe_filter_parallel_tool_calls``).
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
        # vLLM's unified parser (tool parser + its structural tag), for forced tool choices.
        self.unified_cls = None
        if parser_name:
            from vllm.parser import ParserManager

            self.unified_cls = ParserManager.get_parser(tool_parser_name=parser_name,
                                                        enable_auto_tools=enable_auto_tool_choice, tokenizer=tokenizer)

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

    def forced(self, req: EngineRequest) -> bool:
        """``tool_choice`` "required" or a named function: the answer must be a call."""
        return self.active(req) and self.unified_cls is not None and (
            req.tool_choice == "required" or isinstance(req.tool_choice, dict))

    def _unified(self, req: EngineRequest) -> tuple[Any, Any]:
        """vLLM's unified parser for ``req`` and its chat request as that parser adjusted it."""
        request = chat_request(req)
        parser = self.unified_cls(self.tokenizer, request.tools)  # type: ignore[misc]
        return parser, parser.adjust_request(request)

    def structured_outputs(self, req: EngineRequest) -> Any:
        """The constraint vLLM's server puts on a forced tool call's output, on any answer that may
        call at most one tool, or on an answer with the request's own structured outputs, which the
        unified parser combines with the call format as vLLM's server does
        (``StructuredOutputsParams``); None when it constrains nothing."""
        if not (self.forced(req) or (self.active(req) and self.unified_cls is not None
                                     and (not req.parallel_tool_calls or req.structured_outputs))):
            return None
        return self._unified(req)[1].extract_structured_outputs()

    def parser(self, req: EngineRequest) -> tuple[Any, Any]:
        """A fresh parser for ``req`` and vLLM's chat request as the parser adjusted it."""
        request = chat_request(req)
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
        """The calls and the remaining text of a finished answer; None when it called no tool.
        With ``parallel_tool_calls`` false, the first call only."""
        got = self._parse(req, output_ids)
        if got is not None and not req.parallel_tool_calls:
            return got[0][:1], got[1]
        return got

    def _parse(self, req: EngineRequest, output_ids: list[int]) -> tuple[list[ToolCall], str] | None:
        if not self.active(req):
            return None
        if self.forced(req):
            return self._parse_forced(req, output_ids)
        parser, request = self.parser(req)
        text = self.tokenizer.decode(output_ids, skip_special_tokens=bool(request.skip_special_tokens))
        info = parser.extract_tool_calls(text, request)
        if not info.tools_called or not info.tool_calls:
            return None
        calls = [ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments or "{}")
                 for c in info.tool_calls]
        return calls, info.content or ""

    def _parse_forced(self, req: EngineRequest, output_ids: list[int]) -> tuple[list[ToolCall], str] | None:
        parser, request = self._unified(req)
        # vLLM's output text never holds the EOS token that stopped it; a forced answer is parsed whole.
        eos = getattr(self.tokenizer, "eos_token_id", None)
        ids = output_ids[:-1] if output_ids and eos is not None and output_ids[-1] == eos else output_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=bool(request.skip_special_tokens))
        _, content, calls = parser.parse(text, request, enable_auto_tools=self.enable_auto,
                                         model_output_token_ids=ids)
        if not calls:
            return None
        from vllm.renderers.chat_utils import make_tool_call_id

        # vLLM's server gives a call the parser left without an id one of its own, the same way.
        return [ToolCall(id=c.id or make_tool_call_id(), name=c.name, arguments=c.arguments or "{}")
                for c in calls], content or ""


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
        # A forced call in vLLM's JSON format (a parser without a structural tag) is not the format the
        # streaming parser reads: it is sent whole when the answer ends, not as text deltas.
        self.hold = owner.forced(req) and bool(getattr(owner.parser_cls, "supports_required_and_named", False))

    def push(self, new_ids: list[int]) -> ParsedDelta:
        self.ids.extend(new_ids)
        if self.broken or self.hold or not new_ids:
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
        delta = delta_of(dm)
        if not self.req.parallel_tool_calls:   # vLLM's server streams call 0's deltas only
            delta.tool_calls = [d for d in delta.tool_calls if d.index == 0]
        return self.ledger.record(delta)

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


def chat_request(req: EngineRequest) -> Any:
    """vLLM's chat request for ``req``'s tools, as its server builds one (what its parsers read)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest(model="kvmesh", messages=[{"role": "user", "content": ""}],
                                 tools=req.tools, tool_choice=req.tool_choice,
                                 parallel_tool_calls=req.parallel_tool_calls,
                                 # A forced call's format replaces the request's own constraint in vLLM's
                                 # server (and a named tool with one is refused there); with "auto" the
                                 # parser combines the two.
                                 structured_outputs=req.structured_outputs if req.tool_choice == "auto" else None)

def delta_of(dm: Any) -> ParsedDelta:
    """vLLM's ``DeltaMessage`` as a ``ParsedDelta`` (None: nothing new)."""
    if dm is None:
        return ParsedDelta()
    calls = [ToolCallDelta(tc.index, tc.id or "", (tc.function.name or "") if tc.function else "",
                           (tc.function.arguments or "") if tc.function else "") for tc in dm.tool_calls or []]
    return ParsedDelta(dm.content or "", calls, getattr(dm, "reasoning", None) or "")
