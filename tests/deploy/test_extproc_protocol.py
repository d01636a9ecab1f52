"""The ext_proc picker's wire protocol, driven over a real gRPC channel as Envoy would drive it.

The Envoy tests show the end-to-end behaviour; these pin the protocol details a
gateway relies on: the destination in both the header and ``envoy.lb`` dynamic
metadata (same value), route-cache clearing, the body streamed back untouched,
the subset hint from filter metadata, and the error answers.
"""

from __future__ import annotations

import json

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import json_format, struct_pb2

from kvmesh_router.extproc import (
    DEST_HEADER,
    ExtProcConfig,
    NoEligibleEndpointError,
    PickRequest,
    PickResult,
    start_extproc_server,
)

pytestmark = pytest.mark.timeout(60)
POOL = ["10.0.0.1:8000", "10.0.0.2:8000"]


def headers_msg(path: str = "/v1/completions", eos: bool = False, extra: dict[str, str] | None = None,
                subset: list[str] | None = None) -> ep.ProcessingRequest:
    hs = [base_pb2.HeaderValue(key=k, raw_value=v.encode())
          for k, v in {":method": "POST", ":path": path, "x-request-id": "r-1", **(extra or {})}.items()]
    req = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=hs),
                                                              end_of_stream=eos))
    if subset is not None:
        s = struct_pb2.Struct()
        s.update({"x-gateway-destination-endpoint-subset": subset})
        req.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(s)
    return req


def body_msgs(body: bytes, pieces: int = 3) -> list[ep.ProcessingRequest]:
    step = max(1, len(body) // pieces)
    chunks = [body[i:i + step] for i in range(0, len(body), step)]
    return [ep.ProcessingRequest(request_body=ep.HttpBody(body=c, end_of_stream=i == len(chunks) - 1))
            for i, c in enumerate(chunks)]


@pytest.fixture
async def picker():
    seen: list[PickRequest] = []
    done: list[int] = []

    async def pick(req: PickRequest) -> PickResult:
        seen.append(req)
        pool = [a for a in POOL if req.subset is None or a in req.subset]
        if not pool:
            raise NoEligibleEndpointError("no endpoint in the subset")
        return PickResult(address=pool[-1], endpoint_id="e", on_done=done.append)

    server = await start_extproc_server(pick, 0, host="127.0.0.1", config=ExtProcConfig(max_body_bytes=4096))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    yield ep_grpc.ExternalProcessorStub(channel), seen, done
    await channel.close()
    await server.stop(0)


async def run(stub, msgs: list[ep.ProcessingRequest]) -> list[ep.ProcessingResponse]:
    call = stub.Process(iter(msgs))
    return [r async for r in call]


async def test_streamed_body_gets_header_metadata_and_body_back(picker) -> None:
    stub, seen, done = picker
    body = json.dumps({"model": "m", "prompt": [1, 2, 3] * 50}).encode()
    out = await run(stub, [headers_msg(), *body_msgs(body)])
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body"]
    common = out[0].request_headers.response
    (hdr,) = common.header_mutation.set_headers[:1]
    assert hdr.header.key == DEST_HEADER and hdr.header.raw_value.decode() == POOL[-1]
    assert common.clear_route_cache
    md = json_format.MessageToDict(out[0].dynamic_metadata)
    assert md == {"envoy.lb": {DEST_HEADER: POOL[-1]}}
    streamed = out[1].request_body.response.body_mutation.streamed_response
    assert streamed.body == body and streamed.end_of_stream
    assert seen[0].body == json.loads(body) and seen[0].path == "/v1/completions" and seen[0].subset is None
    assert done == [0]   # settled when the stream ended (no response headers in this exchange)


async def test_subset_hint_from_filter_metadata(picker) -> None:
    stub, seen, _ = picker
    body = b'{"model": "m", "prompt": [1]}'
    out = await run(stub, [headers_msg(subset=[POOL[0]]), *body_msgs(body, 1)])
    assert out[0].request_headers.response.header_mutation.set_headers[0].header.raw_value.decode() == POOL[0]
    assert seen[-1].subset == [POOL[0]]
    out = await run(stub, [headers_msg(subset=["192.0.2.9:1"]), *body_msgs(body, 1)])
    assert out[0].immediate_response.status.code == 503
    out = await run(stub, [headers_msg(subset=[]), *body_msgs(body, 1)])
    assert out[0].immediate_response.status.code == 503


async def test_response_headers_get_the_picked_endpoint(picker) -> None:
    stub, _, done = picker
    resp_hdrs = ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":status", raw_value=b"200")])))
    out = await run(stub, [headers_msg(), *body_msgs(b'{"model": "m", "prompt": [1]}', 1), resp_hdrs])
    added = out[-1].response_headers.response.header_mutation.set_headers[0].header
    assert added.key == "x-kvmesh-picked-endpoint" and added.raw_value.decode() == POOL[-1]
    assert done[-1] == 200


async def test_errors(picker) -> None:
    stub, _, _ = picker
    out = await run(stub, [headers_msg(), *body_msgs(b"{broken", 1)])
    assert out[0].immediate_response.status.code == 400
    out = await run(stub, [headers_msg(), *body_msgs(b"[1, 2]", 1)])
    assert out[0].immediate_response.status.code == 400
    out = await run(stub, [headers_msg(), *body_msgs(b'{"prompt": "' + b"x" * 5000 + b'"}', 4)])
    assert out[-1].immediate_response.status.code == 413
    body = json.loads(out[-1].immediate_response.body)
    assert "4096" in body["error"]["message"]


async def test_bodyless_request_is_picked_on_headers(picker) -> None:
    stub, seen, _ = picker
    out = await run(stub, [headers_msg(path="/v1/models", eos=True)])
    assert [r.WhichOneof("response") for r in out] == ["request_headers"]
    assert seen[-1].body is None and seen[-1].path == "/v1/models"


def response_msgs(status: int, content_type: str, chunks: list[bytes]) -> list[ep.ProcessingRequest]:
    hs = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in
          {":status": str(status), "content-type": content_type, "content-length": "99"}.items()]
    return [ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=hs))),
            *[ep.ProcessingRequest(response_body=ep.HttpBody(body=c, end_of_stream=i == len(chunks) - 1))
              for i, c in enumerate(chunks)]]


class Upper:
    """A tap that holds a JSON answer to its end and upper-cases a stream a piece at a time."""

    def __init__(self) -> None:
        self.held = b""

    async def feed(self, chunk: bytes, eos: bool, sse: bool) -> bytes:
        if sse:
            return chunk.upper()
        self.held += chunk
        return self.held.upper() if eos else b""


async def test_a_taps_response_body_is_what_the_tap_gives_back() -> None:
    async def pick(_req: PickRequest) -> PickResult:
        return PickResult(address=POOL[0], tap=Upper())

    server = await start_extproc_server(pick, 0, host="127.0.0.1", config=ExtProcConfig())
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = ep_grpc.ExternalProcessorStub(channel)
            request = [headers_msg(path="/v1/responses"), *body_msgs(b'{"model": "m", "input": "hi"}', 1)]

            def answer(out: list[ep.ProcessingResponse]) -> tuple[list[str], list[bytes]]:
                hdrs = [r for r in out if r.WhichOneof("response") == "response_headers"][0]
                bodies = [r.response_body.response.body_mutation.streamed_response.body
                          for r in out if r.WhichOneof("response") == "response_body"]
                return list(hdrs.response_headers.response.header_mutation.remove_headers), bodies

            # JSON: held back (sent empty) to its end, then rewritten whole; its length goes.
            removed, bodies = answer(await run(stub, [*request, *response_msgs(
                200, "application/json", [b'{"a":', b' "b"}'])]))
            assert removed == ["content-length"] and bodies == [b"", b'{"A": "B"}']
            removed, bodies = answer(await run(stub, [*request, *response_msgs(
                200, "text/event-stream", [b"data: x\n", b"data: y\n"])]))
            assert bodies == [b"DATA: X\n", b"DATA: Y\n"]
            # An error answer is not the tap's: it passes as it came, with its length.
            removed, bodies = answer(await run(stub, [*request, *response_msgs(
                404, "application/json", [b'{"error": "x"}'])]))
            assert removed == [] and bodies == [b'{"error": "x"}']
    finally:
        await server.stop(0)
