"""Reasoning out of a vLLM engine's chat answers, split by vLLM's own parsers.

Why it exists: a reasoning model (DeepSeek-R1, Qwen3, ...) writes its thinking first, between its
own markers (``<think>...</think>``). vLLM's OpenAI server started with ``--reasoning-parser``
returns that part as the answer's ``reasoning`` and the rest as ``content``, and parses tool calls
only in the content. The kvmesh worker runs the engine in-process and the router sees token ids,
so the worker does the same for chat answers (``EngineRequest.reasoning``), with vLLM's unified
parser (``vllm.parser.ParserManager``: the named reasoning parser, then, for a request whose tools
may be called, the worker's tool parser over what follows the reasoning):

* while the answer streams, ``parse_delta`` a token at a time, as vLLM's chat server sees a decode
  step (with the prompt's token ids on the first call, so a template that closed the
  reasoning in the prompt, e.g. Qwen3 with ``enable_thinking`` false, yields content only);
* on the finished answer, ``parse`` with a fresh parser, as vLLM's server answers a request that
  does not stream.

The streamed deltas add up to the final parse (``tool_stream.DeltaLedger``). The parser gets the
chat template keywords the prompt was rendered with, as vLLM's server passes them. Which requests
may call tools, and the constraint a forced call puts on the output, stay ``vllm_tools``'s rules.
Imported only where vLLM is installed.
"""

from __future__ import annotations

import logging
from typing import Any

from kvmesh.tokenization.detokenize import IncrementalDetokenizer
from kvmesh.worker.engine.base import EngineRequest, ParsedDelta, ToolCall
from kvmesh.worker.engine.tool_stream import DeltaLedger, merge
from kvmesh.worker.engine.vllm_tools import VllmToolCalls, chat_request, delta_of

log = logging.getLogger(__name__)

# A finished answer as vLLM's parser reads it: reasoning, content, tool calls (None: no call) and
# how many output tokens were reasoning.
Parse = tuple[str, str, "list[ToolCall] | None", int]


class VllmReasoning:
    """The engine's reasoning parser, composed with its tool parser for requests that may call tools."""

    def __init__(self, reasoning_parser: str, tools: VllmToolCalls, tokenizer: Any) -> None:
        from vllm.parser import ParserManager

        self.tools = tools
        self.tokenizer = tokenizer
        self.plain = ParserManager.get_parser(reasoning_parser_name=reasoning_parser, tokenizer=tokenizer)
        self.with_tools = self.plain
        if tools.parser_name:
            self.with_tools = ParserManager.get_parser(
                tool_parser_name=tools.parser_name, reasoning_parser_name=reasoning_parser,
                enable_auto_tools=tools.enable_auto, tokenizer=tokenizer)

    def parser(self, req: EngineRequest) -> tuple[Any, Any]:
        """A fresh parser for ``req`` and vLLM's chat request as the parser adjusted it."""
        active = self.tools.active(req)
        request = chat_request(req) if active else chat_request(EngineRequest(req.request_id, []))
        cls = self.with_tools if active else self.plain
        parser = cls(self.tokenizer, request.tools, chat_template_kwargs=req.chat_template_kwargs or {})
        try:
            request = parser.adjust_request(request)
        except Exception:   # a parser that cannot adjust this request still parses the text
            log.debug("parser adjust_request failed", exc_info=True)
        parser.set_prompt_token_ids(req.prompt_token_ids)
        return parser, request

    def stream(self, req: EngineRequest) -> VllmReasoningStream:
        return VllmReasoningStream(self, req)

    def parse(self, req: EngineRequest, output_ids: list[int]) -> Parse:
        """The finished answer's reasoning, content and calls, as vLLM's server parses an answer
        it does not stream. With ``parallel_tool_calls`` false, the first call only."""
        parser, request = self.parser(req)
        # vLLM's output text never holds the EOS token that stopped it.
        eos = getattr(self.tokenizer, "eos_token_id", None)
        ids = output_ids[:-1] if output_ids and eos is not None and output_ids[-1] == eos else output_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=bool(request.skip_special_tokens))
        reasoning, content, calls = parser.parse(text, request, enable_auto_tools=self.tools.enable_auto,
                                                 model_output_token_ids=ids)
        found = None
        if calls and self.tools.active(req):
            from vllm.renderers.chat_utils import make_tool_call_id

            # vLLM's server gives a call the parser left without an id one of its own, the same way.
            found = [ToolCall(id=c.id or make_tool_call_id(), name=c.name, arguments=c.arguments or "{}")
                     for c in calls]
            if not req.parallel_tool_calls:
                found = found[:1]
        return reasoning or "", content or "", found, parser.count_reasoning_tokens(ids)


class VllmReasoningStream:
    """One chat answer through vLLM's ``parse_delta``, a token at a time. A parser that fails stops
    streaming: ``finish`` then sends the whole answer, as parsed at the end."""

    def __init__(self, owner: VllmReasoning, req: EngineRequest) -> None:
        self.owner = owner
        self.req = req
        self.parser, self.request = owner.parser(req)
        self.detok = IncrementalDetokenizer(owner.tokenizer, bool(self.request.skip_special_tokens))
        self.ids = self.detok.ids
        self.parsed = 0            # tokens the parser has read
        self.prompt_seen = False
        self.broken = False
        self.ledger = DeltaLedger()

    def push(self, new_ids: list[int], finished: bool = False) -> ParsedDelta:
        """The parse of ``new_ids``, fed to the parser a token at a time as vLLM's server sees a
        decode step's output (its parsers skip a lone marker token, and would keep a marker that
        came inside a longer delta). A token that ends inside a character waits for the next."""
        out = ParsedDelta()
        for i, t in enumerate(new_ids):
            out = merge(out, self._step([t], finished and i == len(new_ids) - 1))
        if not new_ids and finished:
            out = self._step([], True)
        return out

    def _step(self, new_ids: list[int], finished: bool) -> ParsedDelta:
        delta_text = self.detok.push(new_ids, final=finished)
        if self.broken or self.detok.pending:   # a token that ends inside a character waits
            return ParsedDelta()
        # The prompt tells the parser whether reasoning is already closed; it reads it once.
        prompt = None if self.prompt_seen else self.req.prompt_token_ids   # read, never copied
        try:
            dm = self.parser.parse_delta(delta_text, self.ids[self.parsed:], self.request,
                                         prompt_token_ids=prompt, finished=finished)
        except Exception:   # vLLM's server ends the stream here; we fall back to the final parse
            log.warning("streaming reasoning parser failed; the answer is sent when finished", exc_info=True,
                        extra={"request_id": self.req.request_id})
            self.broken = True
            return ParsedDelta()
        self.prompt_seen = True
        self.parsed = len(self.ids)
        delta = delta_of(dm)
        if not self.req.parallel_tool_calls:   # vLLM's server streams call 0's deltas only
            delta.tool_calls = [d for d in delta.tool_calls if d.index == 0]
        return self.ledger.record(delta)

    def finish(self, new_ids: list[int]) -> tuple[ParsedDelta, Parse]:
        """The last output's delta (its tokens, then what the deltas have not sent of the final
        parse) and the final parse."""
        last = self.push(new_ids, finished=True)
        reasoning, content, calls, n = self.owner.parse(self.req, self.ids)
        if not self.broken:
            # The stream's reading is the answer's: it saw the prompt (a template that closed the
            # reasoning there, thinking off), which vLLM's whole-answer parse does not.
            reasoning, content = self.ledger.reasoning, self.ledger.content
        rest = self.ledger.completion(calls or [], content, self.req.request_id, reasoning=reasoning)
        return merge(last, rest), (reasoning, content, calls, n)
