"""A soak explains every failed request: the exception chain, errno, phase and connection reuse.

A 30-minute soak lost 35 requests as bare ``ReadError``: httpx's message is empty and the
errno sits three causes down. These tests make a real server on loopback fail requests in
known ways and check the record says which. They also check that requests in flight when a
soak's time is up are waited for, not cut off and counted as errors.
"""

from __future__ import annotations

import asyncio
import errno
import json
import socket
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from kvmesh_tools.replay.transport import Call, HttpTransport

pytestmark = pytest.mark.timeout(60)

_SSE_OK = [
    {"choices": [{"token_ids": [7]}]},
    {"choices": [], "kvmesh": {"predicted_cached_tokens": 0, "endpoint": "w"},
     "usage": {"prompt_tokens": 3, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}},
]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    n = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            n = int(line.split(b":")[1])
    if n:
        await reader.readexactly(n)
    return head


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0), as a server dropping a connection with unread data does."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _stream_ok(writer: asyncio.StreamWriter, delay_s: float = 0.0) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    await writer.drain()
    if delay_s:
        await asyncio.sleep(delay_s)
    for doc in [*(f"data: {json.dumps(d)}\n\n" for d in _SSE_OK), "data: [DONE]\n\n"]:
        b = doc.encode()
        writer.write(f"{len(b):x}\r\n".encode() + b + b"\r\n")
    writer.write(b"0\r\n\r\n")
    await writer.drain()


async def _serve(handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]):  # noqa: ANN202
    """A loopback HTTP/1.1 server; ``handler`` gets each connection with its number of requests so far."""

    async def conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = 0
        try:
            while True:
                head = await _read_request(reader)
                if head.startswith(b"GET /v1/models"):
                    body = json.dumps({"data": [{"id": "m"}]}).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                                 + str(len(body)).encode() + b"\r\n\r\n" + body)
                    await writer.drain()
                    continue
                await handler(reader, writer, n)
                n += 1
                if writer.transport.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return

    server = await asyncio.start_server(conn, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_a_reset_while_waiting_for_headers_is_recorded_with_its_errno_and_phase() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if n == 0:
            await _stream_ok(writer)
        else:
            _reset(writer)   # the second request on the kept-alive connection is dropped

    server, port = await _serve(handler)
    t = HttpTransport(f"http://127.0.0.1:{port}", "m", 10.0)
    try:
        first = await t.call(Call("r1", [1, 2, 3], 1, "s"))
        assert not first.error and first.output_tokens == 1
        out = await t.call(Call("r2", [1, 2, 3], 1, "s"))
    finally:
        await t.close()
        server.close()
    d = out.error_detail
    assert out.error.startswith("ReadError") and d is not None, out
    assert d["errno"] == errno.ECONNRESET, d
    assert d["phase"] == "wait_headers" and d["new_connection"] is False, d
    assert any("ConnectionResetError" in link for link in d["chain"]), d["chain"]


async def test_a_reset_mid_stream_says_how_far_the_body_got() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        b = f"data: {json.dumps(_SSE_OK[0])}\n\n".encode()
        writer.write(f"{len(b):x}\r\n".encode() + b + b"\r\n")
        await writer.drain()
        await asyncio.sleep(0.2)
        _reset(writer)

    server, port = await _serve(handler)
    t = HttpTransport(f"http://127.0.0.1:{port}", "m", 10.0)
    try:
        out = await t.call(Call("r1", [1, 2, 3], 1, "s"))
    finally:
        await t.close()
        server.close()
    d = out.error_detail
    assert d is not None and d["type"] == "ReadError" and d["errno"] == errno.ECONNRESET, out
    assert d["phase"] == "read_body" and d["new_connection"] is True and d["sse_events"] == 1 and d["tokens"] == 1, d
    # ... and when each phase began, the body's first among the last.
    assert list(d["timeline"])[0] == "connect" and d["timeline"]["read_body"] >= d["timeline"]["connect"], d


async def test_requests_in_flight_when_the_time_is_up_are_waited_for(tmp_path: Path) -> None:
    """The soak stops sending at its end and waits for what it sent: a request that outlives
    the run completes and is no error."""
    from kvmesh_tools.soak.driver import SoakConfig, run_soak
    from kvmesh_tools.soak.report import summarize

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await _stream_ok(writer, delay_s=1.5)   # every request outlives a 1.2 s run

    server, port = await _serve(handler)
    stack = tmp_path / "stack.json"
    stack.write_text(json.dumps({"router_http": f"http://127.0.0.1:{port}", "pids": {}}))
    try:
        run = await run_soak(SoakConfig(stack=str(stack), sessions=3, minutes=0.02, sample_s=0.5, progress=False,
                                        out=str(tmp_path / "out")))
    finally:
        server.close()
    rep = summarize(run)
    assert rep["total"]["requests"] == 3 and rep["total"]["errors"] == 0 and rep["failures"] == [], rep["total"]
