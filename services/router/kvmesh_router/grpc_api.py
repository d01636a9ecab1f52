"""gRPC ``kvmesh.router.v1.Router``: Generate (server-streaming) and ListModels."""

from __future__ import annotations

import logging
import time

import grpc

from kvmesh_api.router.v1 import router_pb2, router_pb2_grpc
from kvmesh_router import metrics
from kvmesh_router.errors import RouterError
from kvmesh_router.service import GenInput, RouterService

log = logging.getLogger(__name__)


def to_input(req: router_pb2.GenerateRequest, deadline: float | None) -> GenInput:
    inp = GenInput(model=req.model, request_id=req.request_id, cache_salt=req.cache_salt,
                   session_id=req.session_id, lora_name=req.lora_name, tenant=req.tenant, policy=req.policy,
                   deadline=deadline)
    inp.sampling.CopyFrom(req.sampling)
    which = req.WhichOneof("input")
    if which == "tokens":
        # Kept as the protobuf field: copying 200k ids into a list costs ~10 ms, while the
        # hash cache slices it and the worker request copies it in C.
        inp.tokens = req.tokens.ids  # type: ignore[assignment]
    elif which == "text":
        inp.text = req.text
    elif which == "chat":
        inp.chat = [{"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})}
                    for m in req.chat.messages]
        inp.add_generation_prompt = req.chat.add_generation_prompt or True
        if not inp.chat:
            inp.chat = None
    return inp


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, service: RouterService) -> None:
        self.service = service

    async def Generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        rem = context.time_remaining()
        deadline = time.monotonic() + rem if rem is not None and rem < 1e9 else None
        which = request.WhichOneof("input")
        if which is None or (which == "chat" and not request.chat.messages):
            metrics.REQUESTS.labels(api="grpc", outcome="bad_request").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "input: one of tokens, text or chat (with messages) is required")
        inp = to_input(request, deadline)
        try:
            async for kind, item in self.service.generate(inp):
                if kind == "chunk":
                    yield router_pb2.GenerateResponse(chunk=router_pb2.Chunk(
                        token_ids=item, text=self._text(request, item)))
                else:
                    yield router_pb2.GenerateResponse(final=router_pb2.Final(
                        usage=item.usage, finish_reason=item.finish_reason, routing=item.routing,
                        request_id=item.request_id, ttft_s=item.ttft_s))
            metrics.REQUESTS.labels(api="grpc", outcome="ok").inc()
        except RouterError as exc:
            metrics.REQUESTS.labels(api="grpc", outcome=type(exc).__name__).inc()
            await context.abort(exc.grpc_code, exc.message)

    def _text(self, request: router_pb2.GenerateRequest, ids: list[int]) -> str:
        tok = self.service.tokenizer
        if not request.return_text or tok is None:
            return ""
        return tok.decode(ids)

    async def ListModels(self, request: router_pb2.ListModelsRequest, context: grpc.aio.ServicerContext):
        cfg = self.service.cfg
        eps = [e.endpoint_id for e in self.service.core.decode_endpoints(cfg.model)]
        return router_pb2.ListModelsResponse(models=[router_pb2.ModelInfo(
            id=cfg.model, max_model_len=self.service.max_model_len(), block_size=cfg.block_size, endpoints=eps)])
