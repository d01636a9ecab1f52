"""Envoy ext_proc endpoint picker: the router as a Gateway API Inference Extension EPP.

Why it exists: platform teams run an Envoy-based gateway in front of their
model servers. In that setup the gateway, not kvmesh, forwards the client's
OpenAI request; it asks an *endpoint picker* over Envoy's external-processing
protocol where to send it. This module is that picker. It scores with exactly
the router's own front-door logic (the ``pick`` callable the router passes in),
so a request lands on the same worker whether it came through Envoy or through
the router's own HTTP/gRPC front door.

Protocol (per the EPP spec):
- request bodies arrive ``FULL_DUPLEX_STREAMED``; chunks are buffered until end of
  stream, the body is parsed, an endpoint is picked, then the headers response
  (``x-gateway-destination-endpoint: ip:port``, route cache cleared) and the
  untouched body (as a streamed body mutation) go back. The same address is set in
  the ``envoy.lb`` dynamic metadata namespace.
- a subset hint in the request's filter metadata
  (``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset``, list or
  comma-separated string) restricts the pick; the same key as a request header
  is honoured for gateways that cannot set metadata.
- no eligible endpoint -> ImmediateResponse 503; shedding load (more than
  ``max_inflight`` requests picked and unfinished, or the picker says so) -> 429;
  bad body -> 400, over ``max_body_bytes`` -> 413.
- response headers, when Envoy sends them, get ``x-kvmesh-picked-endpoint`` and
  ``x-kvmesh-predicted-cached-tokens``.
- response bodies, where Envoy sends them (``FULL_DUPLEX_STREAMED``: the shipped config
  does for ``/v1/responses`` only), pass through unchanged, unless the pick carries a
  ``tap`` (a stored Responses request, whose answer the router keeps) and the response is
  a 200: then its ``content-length`` goes and each piece is what the tap gives back
  (held back pieces are sent empty).
- gRPC health serves ``envoy.service.ext_proc.v3.ExternalProcessor`` (and ``""``
  and ``liveness``) via ``kvmesh.rpc.server.ServiceServer``.

The W3C ``traceparent`` of the pick span is injected into the forwarded request,
so the worker's span joins the same trace.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from opentelemetry import propagate, trace
from prometheus_client import Counter, Gauge, Histogram

from kvmesh.config import load_config
from kvmesh.rpc.server import ServerOptions, ServiceServer
from kvmesh.rpc.tls import TlsConfig

log = logging.getLogger(__name__)
_tracer = trace.get_tracer(__name__)

EXTPROC_SERVICE_NAME = ep.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
DEST_HEADER = "x-gateway-destination-endpoint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
LB_NAMESPACE = "envoy.lb"
PICKED_RESPONSE_HEADER = "x-kvmesh-picked-endpoint"
PREDICTED_RESPONSE_HEADER = "x-kvmesh-predicted-cached-tokens"
MAX_BODY_BYTES = 8 * 1024 * 1024



@dataclass
class ExtProcConfig:
    """Picker limits; env ``KVMESH_EXTPROC_*`` overrides the defaults."""

    ENV_PREFIX: ClassVar[str] = "KVMESH_EXTPROC_"

    max_inflight: int = field(default=0, metadata={
        "help": "requests picked but not yet finished above which new ones get 429 (0 = no shedding)"})
    max_body_bytes: int = field(default=MAX_BODY_BYTES, metadata={"help": "largest request body buffered"})


PICKS = Counter("kvmesh_extproc_picks_total", "ext_proc endpoint picks by outcome", ["outcome"])
INFLIGHT = Gauge("kvmesh_extproc_inflight", "requests picked through ext_proc and not yet finished")
PICK_LATENCY = Histogram("kvmesh_extproc_pick_seconds", "time to pick an endpoint for one request",
                         buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0))


# --------------------------------------------------------------------------- picker contract


class PickError(Exception):
    """The picker refuses a request; Envoy answers with ``http_status`` and the message."""

    http_status = 500


class BadRequestError(PickError):
    http_status = 400


class UnauthenticatedError(PickError):
    """No valid API key (the router's ``--auth keys``): Envoy answers 401."""

    http_status = 401


class NoEligibleEndpointError(PickError):
    http_status = 503


class ShedLoadError(PickError):
    http_status = 429


@dataclass
class PickRequest:
    """One HTTP request as the gateway saw it."""

    request_id: str
    method: str
    path: str
    headers: dict[str, str]
    body: dict[str, Any] | None           # parsed JSON body (None for GET and body-less requests)
    subset: list[str] | None = None       # allowed worker HTTP addresses (ip:port); None = whole pool


class BodyTap(Protocol):
    """Sees a successful answer's body on its way to the client, and may rewrite it."""

    async def feed(self, chunk: bytes, eos: bool, sse: bool) -> bytes:
        """What to send on in place of ``chunk`` (``sse``: the answer is an event stream)."""


@dataclass
class PickResult:
    """Where to send it: ``address`` is the worker's HTTP ``ip:port`` (what Envoy dials)."""

    address: str
    endpoint_id: str = ""
    predicted_cached_tokens: int = 0
    reason: str = ""
    # Called once when the request is over (the gateway closed the ext_proc stream) with the
    # upstream HTTP status (0 = none seen); lets the router settle its in-flight bookkeeping.
    on_done: Callable[[int], Any] | None = None
    extra_headers: dict[str, str] = field(default_factory=dict)
    # The request body to forward instead of the one received (the tenant's cache_salt set); None = as is.
    body: bytes | None = None
    tap: BodyTap | None = None


PickFn = Callable[[PickRequest], Awaitable[PickResult]]


# --------------------------------------------------------------------------- helpers


def _header_value(h: base_pb2.HeaderValue) -> str:
    return h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value


def _set_header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _parse_subset(raw: Any) -> list[str]:
    if isinstance(raw, str):
        return [s.strip() for s in raw.split(",") if s.strip()]
    if isinstance(raw, (list, tuple)):
        out: list[str] = []
        for item in raw:
            out.extend(_parse_subset(item))
        return out
    return []


def subset_from(req: ep.ProcessingRequest, headers: dict[str, str]) -> list[str] | None:
    """The subset hint from filter metadata (preferred) or the request header; None if absent."""
    md = req.metadata_context.filter_metadata
    if SUBSET_NAMESPACE in md:
        fields = md[SUBSET_NAMESPACE].fields
        if SUBSET_KEY in fields:
            from google.protobuf.json_format import MessageToDict

            val = MessageToDict(md[SUBSET_NAMESPACE])[SUBSET_KEY]
            return _parse_subset(val)
    if SUBSET_KEY in headers:
        return _parse_subset(headers[SUBSET_KEY])
    return None


def immediate(status: int, message: str, details: str = "") -> ep.ProcessingResponse:
    body = json.dumps({"error": {"message": message, "type": "kvmesh_endpoint_picker", "code": status}})
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),
        headers=ep.HeaderMutation(set_headers=[_set_header("content-type", "application/json")]),
        body=body.encode(),
        details=details or f"kvmesh_epp_{status}",
    ))


def _lb_metadata(address: str) -> struct_pb2.Struct:
    md = struct_pb2.Struct()
    md.update({LB_NAMESPACE: {DEST_HEADER: address}})
    return md


# --------------------------------------------------------------------------- servicer


class _Stream:
    """State of one HTTP request's ext_proc stream."""

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.subset: list[str] | None = None
        self.result: PickResult | None = None
        self.request_id = ""
        self.status = 0
        self.counted = False
        self.tap_sse: bool | None = None   # the response body goes through the pick's tap (an event stream?)

    def done(self, servicer: ExtProcServicer) -> None:
        """The HTTP request is over (the gateway closed the stream): settle the bookkeeping once."""
        if self.counted:
            self.counted = False
            servicer.inflight -= 1
            INFLIGHT.set(servicer.inflight)
        if self.result is not None and self.result.on_done is not None:
            hook, self.result.on_done = self.result.on_done, None
            try:
                hook(self.status)
            except Exception:  # bookkeeping must never break the data path
                log.exception("on_done hook failed", extra={"request_id": self.request_id})


class ExtProcServicer(ep_grpc.ExternalProcessorServicer):
    """``envoy.service.ext_proc.v3.ExternalProcessor`` over a router ``pick`` callable."""

    def __init__(self, pick: PickFn, config: ExtProcConfig | None = None) -> None:
        self.pick = pick
        self.config = config or ExtProcConfig()
        self.max_body_bytes = self.config.max_body_bytes
        self.inflight = 0

    async def Process(self, request_iterator: AsyncIterator[ep.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[ep.ProcessingResponse]:
        st = _Stream()
        try:
            async for req in request_iterator:
                kind = req.WhichOneof("request")
                if kind == "request_headers":
                    st.headers = {h.key.lower(): _header_value(h) for h in req.request_headers.headers.headers}
                    st.request_id = st.headers.get("x-request-id") or uuid.uuid4().hex
                    st.subset = subset_from(req, st.headers)
                    if req.request_headers.end_of_stream:
                        for resp in await self._decide(st, None):
                            yield resp
                elif kind == "request_body":
                    if st.result is not None:
                        # Picked already (trailers path): pass any further body through unchanged.
                        yield self._body_passthrough(req.request_body.body, req.request_body.end_of_stream)
                        continue
                    st.body.extend(req.request_body.body)
                    if len(st.body) > self.max_body_bytes:
                        PICKS.labels("too_large").inc()
                        yield immediate(413, f"request body over {self.max_body_bytes} bytes")
                        return
                    if req.request_body.end_of_stream:
                        for resp in await self._decide(st, bytes(st.body)):
                            yield resp
                elif kind == "request_trailers":
                    if st.result is None:
                        for resp in await self._decide(st, bytes(st.body), body_eos=False):
                            yield resp
                    yield ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
                elif kind == "response_headers":
                    yield self._response_headers(st, req.response_headers)
                elif kind == "response_body":
                    yield await self._response_body(st, req.response_body.body, req.response_body.end_of_stream)
                elif kind == "response_trailers":
                    yield ep.ProcessingResponse(response_trailers=ep.TrailersResponse())
        finally:
            st.done(self)

    @staticmethod
    def _response_headers(st: _Stream, headers: ep.HttpHeaders) -> ep.ProcessingResponse:
        got = {h.key.lower(): _header_value(h) for h in headers.headers.headers}
        st.status = int(got.get(":status") or 0)
        if st.result is None:
            return ep.ProcessingResponse(response_headers=ep.HeadersResponse())
        # What was picked and what it should have cached, next to the engine's own usage.
        set_headers = [_set_header(PICKED_RESPONSE_HEADER, st.result.address),
                       _set_header(PREDICTED_RESPONSE_HEADER, str(st.result.predicted_cached_tokens))]
        if st.result.tap is None or st.status != 200 or headers.end_of_stream:
            return ep.ProcessingResponse(response_headers=ep.HeadersResponse(
                response=ep.CommonResponse(header_mutation=ep.HeaderMutation(set_headers=set_headers))))
        # The tap may rewrite the body, so its length goes; Envoy sends the client chunked.
        st.tap_sse = "text/event-stream" in got.get("content-type", "")
        return ep.ProcessingResponse(response_headers=ep.HeadersResponse(response=ep.CommonResponse(
            header_mutation=ep.HeaderMutation(set_headers=set_headers, remove_headers=["content-length"]))))

    async def _response_body(self, st: _Stream, body: bytes, eos: bool) -> ep.ProcessingResponse:
        if st.tap_sse is None or st.result is None or st.result.tap is None:
            return self._body_passthrough(body, eos, response=True)
        try:
            out = await st.result.tap.feed(body, eos, st.tap_sse)
        except Exception:   # the answer must reach the client even if keeping it fails
            log.exception("response tap failed", extra={"request_id": st.request_id})
            st.tap_sse, out = None, body
        return self._body_passthrough(out, eos, response=True)

    @staticmethod
    def _body_passthrough(body: bytes, eos: bool, response: bool = False) -> ep.ProcessingResponse:
        br = ep.BodyResponse(response=ep.CommonResponse(body_mutation=ep.BodyMutation(
            streamed_response=ep.StreamedBodyResponse(body=body, end_of_stream=eos))))
        return ep.ProcessingResponse(response_body=br) if response else ep.ProcessingResponse(request_body=br)

    async def _decide(self, st: _Stream, raw: bytes | None, body_eos: bool = True) -> list[ep.ProcessingResponse]:
        """Pick an endpoint; the responses that complete the request phase (or one ImmediateResponse)."""
        t0 = time.perf_counter()
        body: dict[str, Any] | None = None
        if raw:
            try:
                parsed = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                PICKS.labels("bad_request").inc()
                return [immediate(400, f"request body is not valid JSON: {exc}")]
            if not isinstance(parsed, dict):
                PICKS.labels("bad_request").inc()
                return [immediate(400, "request body must be a JSON object")]
            body = parsed
        preq = PickRequest(request_id=st.request_id, method=st.headers.get(":method", ""),
                           path=st.headers.get(":path", ""), headers=st.headers, body=body, subset=st.subset)
        # The span continues the client's trace (traceparent in the HTTP headers), not the
        # ext_proc gRPC stream's: one trace per HTTP request.
        parent = propagate.extract(st.headers)
        with _tracer.start_as_current_span("router.extproc.pick", context=parent,
                                           kind=trace.SpanKind.SERVER) as span:
            span.set_attribute("http.route", preq.path)
            span.set_attribute("kvmesh.request_id", st.request_id)
            if body is not None and isinstance(body.get("model"), str):
                span.set_attribute("gen_ai.request.model", body["model"])
            if st.subset is not None:
                span.set_attribute("kvmesh.subset_size", len(st.subset))
            try:
                limit = self.config.max_inflight
                if limit and self.inflight >= limit:
                    raise ShedLoadError(f"shedding load: {self.inflight} requests in flight (limit {limit})")
                if st.subset is not None and not st.subset:
                    raise NoEligibleEndpointError("the endpoint subset hint is empty")
                result = await self.pick(preq)
                if st.subset is not None and result.address not in st.subset:
                    raise NoEligibleEndpointError(
                        f"picked {result.address}, which is outside the subset hint {st.subset}")
            except PickError as exc:
                outcome = {400: "bad_request", 401: "unauthenticated", 404: "not_found", 429: "shed",
                           503: "no_endpoint"}.get(exc.http_status, "error")
                PICKS.labels(outcome).inc()
                span.set_attribute("kvmesh.pick.outcome", outcome)
                log.info("ext_proc refused request", extra={"request_id": st.request_id, "status": exc.http_status,
                                                           "reason": str(exc)})
                return [immediate(exc.http_status, str(exc))]
            except Exception as exc:  # a picker bug must not hang the gateway's request
                PICKS.labels("error").inc()
                log.exception("ext_proc pick failed", extra={"request_id": st.request_id})
                return [immediate(500, f"endpoint picker error: {type(exc).__name__}")]
            st.result = result
            st.counted = True
            self.inflight += 1
            INFLIGHT.set(self.inflight)
            span.set_attribute("kvmesh.endpoint", result.endpoint_id or result.address)
            span.set_attribute("server.address", result.address)
            span.set_attribute("gen_ai.usage.cached_tokens_predicted", result.predicted_cached_tokens)
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
        PICKS.labels("picked").inc()
        PICK_LATENCY.observe(time.perf_counter() - t0)
        set_headers = [_set_header(DEST_HEADER, result.address)]
        set_headers += [_set_header(k, v) for k, v in {**carrier, **result.extra_headers}.items()]
        replaced = raw is not None and result.body is not None
        headers_resp = ep.ProcessingResponse(
            request_headers=ep.HeadersResponse(response=ep.CommonResponse(
                # A replaced body has another length: Envoy sends it on without the client's.
                header_mutation=ep.HeaderMutation(set_headers=set_headers,
                                                  remove_headers=["content-length"] if replaced else []),
                clear_route_cache=True)),
            dynamic_metadata=_lb_metadata(result.address),
        )
        out = [headers_resp]
        if raw is not None:
            out.append(self._body_passthrough(result.body if replaced else raw, body_eos))
        log.debug("ext_proc picked", extra={"request_id": st.request_id, "address": result.address,
                                           "endpoint": result.endpoint_id, "reason": result.reason})
        return out


# --------------------------------------------------------------------------- server


async def start_extproc_server(pick: PickFn, port: int, host: str = "127.0.0.1", ready: bool = True,
                               config: ExtProcConfig | None = None, tls: TlsConfig | None = None) -> ServiceServer:
    """Serve the ext_proc picker on its own gRPC port (with health for its service name).

    ``config`` defaults to ``ExtProcConfig`` from the environment (``KVMESH_EXTPROC_*``).
    Returns the started ``ServiceServer``: ``.port`` is the bound port; call
    ``set_ready`` to flip readiness and ``stop()`` on shutdown.
    """
    config = config or load_config(ExtProcConfig)
    servicer = ExtProcServicer(pick, config)
    server = ServiceServer(
        "router-extproc",
        [(ep_grpc.add_ExternalProcessorServicer_to_server, servicer, EXTPROC_SERVICE_NAME)],
        ServerOptions(host=host, port=port, tls=tls),
        # No gRPC tracing interceptor: one ext_proc stream is one HTTP request, and its span
        # is the pick span parented on the HTTP request's own trace context.
        interceptors=[],
    )
    await server.start()
    if ready:
        await server.set_ready(True)
    log.info("ext_proc endpoint picker listening", extra={"host": host, "port": server.port})
    return server
