"""A worker's OpenAI Responses API (``POST /v1/responses``), next to its completions and chat.

Why it exists: behind Envoy the gateway forwards the client's own request to the worker the
picker chose, and the picker accepts ``/v1/responses`` bodies (Codex CLI's default API), so the
worker must answer them too, as a vLLM pod does. The request becomes the chat request it renders
to (``kvmesh.responses_api.requests``, the router's conversion), which this worker renders,
tokenizes and generates like a chat completion; the answer is a ``response`` object or its event
stream (``kvmesh.responses_api``). Nothing is stored, as on the router.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvmesh.openai import sse
from kvmesh.openai.requests import read_json
from kvmesh.request_ids import engine_request_id
from kvmesh.responses_api.output import ResponseHead, output_items, usage
from kvmesh.responses_api.requests import parse_responses
from kvmesh.responses_api.stream import ResponseEvents
from kvmesh.worker.engine.base import EngineError, EngineOutput

if TYPE_CHECKING:
    from kvmesh.worker.http_api import WorkerHttpApi

Item = tuple[list[int], str, EngineOutput]


class WorkerResponses:
    """The Responses handler over a worker's HTTP API object (its engine, tokenizer and helpers)."""

    def __init__(self, api: WorkerHttpApi) -> None:
        self.api = api

    def mount(self, app: FastAPI) -> None:
        app.add_api_route("/v1/responses", self.create, methods=["POST"])

    async def create(self, request: Request) -> Response:
        api = self.api
        rreq = parse_responses(await read_json(request, api.max_body_bytes), request.headers)
        req = rreq.chat
        api._check_model(req.model)
        ids = api.prompt_ids(req)
        head = ResponseHead(rreq, api.model)
        ereq = api._engine_request(req, ids, engine_request_id(request.headers.get("x-request-id", "") or head.id))
        parallel = req.chat_request is None or req.chat_request.parallel_tool_calls
        hold = req.chat_request is not None and req.chat_request.tools_active
        agen = api._run(ereq, [])
        # The first item before answering, so an engine's refusal is a 4xx, not an event in a 200.
        try:
            first = await agen.__anext__()
        except StopAsyncIteration:
            first = None
        except EngineError as exc:
            raise api.engine_error(exc) from None
        if req.stream:
            events = self._events(agen, first, ResponseEvents(head), len(ids), ereq.request_id, hold, parallel)
            return sse.sse_response(events, headers=api._headers())
        text, n_out, last = "", 0, None
        try:
            async for new_ids, delta, out in _chain(first, agen):
                text, n_out, last = text + delta, n_out + len(new_ids), out
        except EngineError as exc:
            raise api.engine_error(exc) from None
        assert last is not None
        calls = _calls(last, parallel)
        if last.tool_calls or last.reasoning is not None:   # the engine's parse: text that is not a call
            text = last.content or ""
        items = output_items(text, calls, rreq, last.reasoning)
        return JSONResponse(head.response(_status(last), items, self._usage(last, len(ids), n_out),
                                          kvmesh={"endpoint": api.endpoint_id}), headers=api._headers())

    @staticmethod
    def _usage(out: EngineOutput, n_prompt: int, n_out: int) -> dict[str, Any]:
        return usage(out.num_prompt_tokens or n_prompt, out.num_output_tokens or n_out, out.num_cached_tokens,
                     out.num_reasoning_tokens)

    async def _events(self, agen: AsyncIterator[Item], first: Item | None, ev: ResponseEvents, n_prompt: int,
                      engine_id: str, hold: bool, parallel: bool) -> AsyncIterator[bytes]:
        """``hold``: the answer may be a tool call, so its text goes out once the engine has parsed it.
        An engine with a reasoning parser streams its reading (``out.delta``): reasoning, then text."""
        yield ev.start()
        held: list[str] = []
        n_out = 0
        try:
            async for new_ids, delta, out in _chain(first, agen):
                n_out += len(new_ids)
                if out.delta is not None:
                    yield ev.reasoning(out.delta.reasoning)
                    if not hold:
                        delta = out.delta.content   # a reasoning parser's reading, not the decoded tokens
                if not hold:
                    yield ev.text(delta)
                else:
                    held.append(delta)
                if not out.finished:
                    continue
                if hold:
                    text = (out.content or "") if out.tool_calls or out.reasoning is not None else "".join(held)
                    yield ev.text(text)
                for c in _calls(out, parallel):
                    yield ev.call(c.id, c.name, c.arguments)
                yield ev.finish(_status(out) == "incomplete", self._usage(out, n_prompt, n_out),
                                kvmesh={"endpoint": self.api.endpoint_id})
                return
        except EngineError as exc:
            yield ev.failed("server_error", str(exc))
        except asyncio.CancelledError:
            await self.api.engine.abort(engine_id)
            raise


async def _chain(first: Item | None, rest: AsyncIterator[Item]) -> AsyncIterator[Item]:
    if first is not None:
        yield first
        if first[2].finished:
            return
    async for item in rest:
        yield item


def _calls(out: EngineOutput, parallel: bool) -> list[Any]:
    calls = list(out.tool_calls or [])
    return calls if parallel else calls[:1]


def _status(out: EngineOutput) -> str:
    return "incomplete" if out.finish_reason == "length" else "completed"
