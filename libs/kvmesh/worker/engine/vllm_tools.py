"""Tool calls out of a vLLM engine's answer, parsed by vLLM's own tool parsers.

Why it exists: a chat answer that calls tools is text in the model's own format (Hermes
``<tool_call>{...}</tool_call>``, Llama JSON, Mistral ``[TOOL_CALLS]``...). vLLM's OpenAI server
turns it into ``tool_calls`` with the parser named by ``--tool-call-parser``; the kvmesh worker
runs the engine in-process and the router gets token ids, so the worker does the same, with the
same parsers (``vllm.tool_parsers.ToolParserManager``), on the finished answer, and applies
vLLM's rules for which requests may ask for tools: ``tool_choice="auto"`` needs
``enable_auto_tool_choice`` and a parser, ``"required"`` or a named tool a parser. Imported only
where vLLM is installed.
"""

from __future__ import annotations

import logging
from typing import Any

from kvmesh.worker.engine.base import EngineRequest, InvalidRequestError, ToolCall

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

    def parse(self, req: EngineRequest, output_ids: list[int]) -> tuple[list[ToolCall], str] | None:
        """The calls and the remaining text of a finished answer; None when it called no tool."""
        if self.parser_cls is None or not req.tools or req.tool_choice in (None, "none"):
            return None
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest(model="kvmesh", messages=[{"role": "user", "content": ""}],
                                        tools=req.tools, tool_choice=req.tool_choice)
        parser = self.parser_cls(self.tokenizer, request.tools)
        try:
            request = parser.adjust_request(request)
        except Exception:  # a parser that cannot adjust this request still parses the text
            log.debug("tool parser adjust_request failed", exc_info=True)
        text = self.tokenizer.decode(output_ids, skip_special_tokens=bool(request.skip_special_tokens))
        info = parser.extract_tool_calls(text, request)
        if not info.tools_called or not info.tool_calls:
            return None
        calls = [ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments or "{}")
                 for c in info.tool_calls]
        return calls, info.content or ""
