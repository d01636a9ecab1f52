"""Requests that do not parse are refused with ``INVALID_ARGUMENT``, on every service.

Why: grpcio turns an exception raised by a request deserializer into status
``UNKNOWN`` ("Unexpected error"), which tells a client nothing and looks like a
server bug. This interceptor wraps each handler's deserializer so a parse
failure becomes a marker value, and the handler aborts with
``INVALID_ARGUMENT`` and the parser's message before any servicer code runs.
For client-streaming calls the check happens message by message, as the
servicer reads them.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

log = logging.getLogger(__name__)

MAX_DETAIL_CHARS = 200


class ParseFailure:
    """What the wrapped deserializer returns instead of raising."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error

    @property
    def message(self) -> str:
        text = str(self.error) or type(self.error).__name__
        return f"request does not parse: {text[:MAX_DETAIL_CHARS]}"


def _safe(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception as exc:  # noqa: BLE001 - any parser error is the client's fault
            return ParseFailure(exc)

    return parse


async def _refuse(failure: ParseFailure, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, failure.message)


async def _checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    async for req in requests:
        if isinstance(req, ParseFailure):
            await _refuse(req, context)
        yield req


def _wrap(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    deser = _safe(handler.request_deserializer)
    ser = handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        inner = handler.stream_stream

        async def stream_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            async for resp in inner(_checked(requests, context), context):
                yield resp

        return grpc.stream_stream_rpc_method_handler(stream_stream, request_deserializer=deser,
                                                     response_serializer=ser)
    if handler.request_streaming:
        inner = handler.stream_unary

        async def stream_unary(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            return await inner(_checked(requests, context), context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, request_deserializer=deser,
                                                    response_serializer=ser)
    if handler.response_streaming:
        inner = handler.unary_stream

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, ParseFailure):
                await _refuse(request, context)
            out = inner(request, context)
            if hasattr(out, "__aiter__"):
                async for resp in out:
                    yield resp
            else:  # a coroutine writing with context.write
                await out

        return grpc.unary_stream_rpc_method_handler(unary_stream, request_deserializer=deser,
                                                    response_serializer=ser)
    inner = handler.unary_unary

    async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, ParseFailure):
            await _refuse(request, context)
        return await inner(request, context)

    return grpc.unary_unary_rpc_method_handler(unary_unary, request_deserializer=deser, response_serializer=ser)


class ParseGuardInterceptor(grpc.aio.ServerInterceptor):
    """Maps request parse failures to ``INVALID_ARGUMENT`` (install it first)."""

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return _wrap(handler)
