"""A recording OpenAI server with vLLM's /metrics, for router tests that need no real engine.

It answers ``/v1/chat/completions`` and ``/v1/completions`` (JSON or SSE; with
``return_token_ids`` each chunk carries its token ids, as vLLM's), vLLM's Anthropic
``/v1/messages`` and its ``/v1/responses`` with a fixed text and a usage block, keeps every body it received, and
serves the three vLLM gauges the router reads. Served by uvicorn in the test's own event loop on a port it binds (0).
The vLLM tier (tests/services/router/test_router_vllm_external.py) covers real vLLM.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse


class OpenAIEngine:
    def __init__(self, model: str = "tiny-llama", log: list[dict[str, Any]] | None = None) -> None:
        self.model = model
        self.bodies: list[dict[str, Any]] = []
        self.log = log   # shared by several engines: every body in arrival order
        self.headers: list[dict[str, str]] = []
        self.waiting = 0
        self.running = 0
        self.kv_usage = 0.0
        # Data parallel: (waiting, running, kv_usage) per engine label (DP rank); None = one engine.
        self.engine_loads: dict[str, tuple[int, int, float]] | None = None
        self.metrics_status = 200
        self.cached_tokens = 0
        self.break_stream = False   # die after the first SSE event (a crashed engine mid-answer)
        self.server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None
        self.port = 0
        app = FastAPI()
        app.add_api_route("/metrics", self._metrics, methods=["GET"])
        app.add_api_route("/v1/chat/completions", self._chat, methods=["POST"])
        app.add_api_route("/v1/completions", self._chat, methods=["POST"])
        app.add_api_route("/v1/messages", self._messages, methods=["POST"])
        app.add_api_route("/v1/responses", self._responses, methods=["POST"])
        self.app = app

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> OpenAIEngine:
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning",
                                                    lifespan="off"))
        self.server.install_signal_handlers = lambda: None
        self._task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self.server is not None and self._task is not None:
            self.server.should_exit = True
            await self._task

    async def _metrics(self) -> Response:
        if self.metrics_status != 200:
            return PlainTextResponse("oops", status_code=self.metrics_status)
        lab = f'{{engine="0",model_name="{self.model}"}}'
        if self.engine_loads is not None:
            lines = []
            for name, idx in (("vllm:num_requests_waiting", 0), ("vllm:num_requests_running", 1),
                              ("vllm:kv_cache_usage_perc", 2)):
                lines.append(f"# TYPE {name} gauge")
                lines += [f'{name}{{engine="{e}",model_name="{self.model}"}} {v[idx]}'
                          for e, v in self.engine_loads.items()]
            return PlainTextResponse("\n".join(lines) + "\n")
        return PlainTextResponse(f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{lab} "
                                 f"{self.running}\n# TYPE vllm:num_requests_waiting gauge\n"
                                 f"vllm:num_requests_waiting{lab} {self.waiting}\n"
                                 f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{lab} "
                                 f"{self.kv_usage}\n")

    async def _record(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        self.bodies.append(body)
        if self.log is not None:
            self.log.append(body)
        self.headers.append(dict(request.headers))
        return body

    async def _messages(self, request: Request) -> Response:
        """vLLM's Anthropic endpoint: ``input_tokens`` is the uncached part of the prompt."""
        body = await self._record(request)
        if body.get("model") != self.model:
            return JSONResponse({"type": "error", "error": {"type": "not_found_error", "message": "no such model"}},
                                status_code=404)
        usage = {"input_tokens": 10 - self.cached_tokens, "output_tokens": 2,
                 "cache_read_input_tokens": self.cached_tokens}
        if not body.get("stream"):
            return JSONResponse({"id": "msg_x", "type": "message", "role": "assistant", "model": self.model,
                                 "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn",
                                 "stop_sequence": None, "usage": usage})

        def ev(kind: str, data: dict[str, Any]) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

        async def events():
            yield ev("message_start", {"message": {"id": "msg_x", "type": "message", "role": "assistant",
                                                   "model": self.model, "content": [], "stop_reason": None,
                                                   "stop_sequence": None, "usage": {**usage, "output_tokens": 0}}})
            yield ev("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
            for piece in ("h", "i"):
                yield ev("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": piece}})
                if self.break_stream:
                    raise RuntimeError("engine died mid-stream")
            yield ev("content_block_stop", {"index": 0})
            yield ev("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None}, "usage": usage})
            yield ev("message_stop", {})

        return StreamingResponse(events(), media_type="text/event-stream")

    async def _responses(self, request: Request) -> Response:
        """vLLM's Responses endpoint: ``input_tokens`` is the whole prompt, ``cached_tokens`` inside it."""
        body = await self._record(request)
        if body.get("model") != self.model:
            return JSONResponse({"error": {"message": "no such model", "type": "NotFoundError", "param": None,
                                           "code": 404}}, status_code=404)
        usage = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": self.cached_tokens},
                 "output_tokens": 2, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 12}
        n = len(self.bodies)   # ids of its own per answer, as vLLM's
        item = {"type": "message", "id": f"msg_{n}", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "hi", "annotations": []}]}

        def response(status: str, output: list[Any], use: Any) -> dict[str, Any]:
            return {"id": f"resp_{self.port}_{n}", "object": "response", "created_at": 0, "status": status, "model": self.model,
                    "output": output, "usage": use, "parallel_tool_calls": True, "tool_choice": "auto",
                    "tools": []}

        if not body.get("stream"):
            return JSONResponse(response("completed", [item], usage))

        def ev(n: int, kind: str, data: dict[str, Any]) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': n, **data})}\n\n"

        async def events():
            yield ev(0, "response.created", {"response": response("in_progress", [], None)})
            yield ev(1, "response.output_item.added", {"output_index": 0, "item": {**item, "content": [],
                                                                                   "status": "in_progress"}})
            for k, piece in enumerate(("h", "i")):
                yield ev(2 + k, "response.output_text.delta", {"item_id": item["id"], "output_index": 0,
                                                               "content_index": 0, "delta": piece})
                if self.break_stream:
                    raise RuntimeError("engine died mid-stream")
            yield ev(4, "response.output_item.done", {"output_index": 0, "item": item})
            yield ev(5, "response.completed", {"response": response("completed", [item], usage)})

        return StreamingResponse(events(), media_type="text/event-stream")

    async def _chat(self, request: Request) -> Response:
        body = await self._record(request)
        if body.get("model") != self.model:
            return JSONResponse({"object": "error", "message": "no such model", "code": 404}, status_code=404)
        if isinstance(body.get("max_tokens"), int) and body["max_tokens"] < 1:   # vLLM's own validation
            return JSONResponse({"error": {"message": "max_tokens must be at least 1", "type": "BadRequestError",
                                           "param": None, "code": 400}}, status_code=400)
        usage = {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12,
                 "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        msg = {"role": "assistant", "content": "hi"}
        if not body.get("stream"):
            return JSONResponse({"id": "x", "object": "chat.completion", "model": self.model,
                                 "choices": [{"index": 0, "message": msg, "finish_reason": "stop",
                                              "logprobs": {"content": []} if body.get("logprobs") else None}],
                                 "usage": usage})

        async def events():
            for n, piece in enumerate(("h", "i")):
                if body.get("return_token_ids"):   # completions: each delta's ids
                    choice = {"index": 0, "text": piece, "token_ids": [100 + n],
                              "finish_reason": "length" if n else None}
                else:
                    choice = {"index": 0, "delta": {"content": piece}}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                if self.break_stream:
                    raise RuntimeError("engine died mid-stream")
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")
