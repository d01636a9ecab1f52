"""A peer whose connection takes longer than the reconnect backoff is still reached on the first call.

gRPC's C-core gives one connection attempt ``grpc.min_reconnect_backoff_ms`` at the least
(kvmesh.rpc.reconnect). A proxy here holds each connection for a second before it reaches a real
health server, as a loaded machine or a slow TLS handshake does: a kvmesh channel's first call
waits it out; a control channel whose attempts get 100 ms fails with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvmesh.rpc.channel import channel_options

HOLD_S = 1.0


@contextlib.asynccontextmanager
async def _slow_peer() -> AsyncIterator[str]:
    """A health server behind a TCP proxy that holds each connection ``HOLD_S`` before relaying it."""
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    tasks: set[asyncio.Task] = set()

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        w.close()

    async def relay(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        await asyncio.sleep(HOLD_S)
        sr, sw = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.gather(pipe(cr, sw), pipe(sr, cw))

    def accepted(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        t = asyncio.ensure_future(relay(cr, cw))
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    proxy = await asyncio.start_server(accepted, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{proxy.sockets[0].getsockname()[1]}"
    finally:
        proxy.close()
        for t in list(tasks):
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.stop(0)


async def _first_call(options: list[tuple[str, object]]) -> grpc.StatusCode:
    async with _slow_peer() as target, grpc.aio.insecure_channel(target, options=options) as ch:
        try:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


@pytest.mark.timeout(60)
async def test_a_slow_handshake_is_waited_for_on_the_first_call() -> None:
    # retry_attempts=1: as the router's lookups, no retry hides a failed attempt.
    assert await _first_call(channel_options(retry_attempts=1)) == grpc.StatusCode.OK


@pytest.mark.timeout(60)
async def test_control_attempts_as_short_as_the_backoff_fail_the_first_call() -> None:
    short = [(k, 100 if k == "grpc.min_reconnect_backoff_ms" else v) for k, v in channel_options(retry_attempts=1)]
    assert await _first_call(short) == grpc.StatusCode.UNAVAILABLE
