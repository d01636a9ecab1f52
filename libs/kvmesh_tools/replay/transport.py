"""The two ways to talk to the router: gRPC ``Generate`` and OpenAI HTTP ``/v1/completions``.

Both return the same ``Outcome`` so the replayer does not care which front door it used.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import grpc
import httpx

from kvmesh.rpc.channel import aio_channel
from kvmesh.rpc.tls import TlsConfig
from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.router.v1 import router_pb2, router_pb2_grpc
from kvmesh_tools.replay.errors import describe_error, phase_of, summary


@dataclass
class Outcome:
    sent: float = 0.0
    first_token: float | None = None
    finish: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached: int = 0
    cached_gpu: int = 0
    cached_offload: int = 0
    # Of ``cached``, what no engine computed for this request (the router's ``reused_tokens``):
    # a split's decode engine counts the KV its prefill engine computed as cached. None: the
    # answer does not say (a pass-through to external engines), and ``cached`` is all there is.
    reused_tokens: int | None = None
    transferred: int = 0
    moved: bool = False       # sent away from its session's previous endpoint (RoutingDecision.moved)
    given_up: int = 0         # the cached tokens that move gave up (RoutingDecision.given_up_tokens)
    predicted: int | None = None
    endpoint: str = ""
    split: bool = False
    mismatch: str = ""   # why predicted != cached (kvmesh.routing.fidelity), "" when equal
    # Where the time to first token went, as the stack reports it: the router's decision (request
    # in -> endpoint chosen; of it, the index lookup) and the engine's own time to first token
    # (request in at the worker -> first token: its queue, restores and prefill). None: not reported.
    decision_ms: float | None = None
    lookup_ms: float | None = None
    engine_ttft_s: float | None = None
    error: str = ""
    # When ``error``: the exception chain, errno, the phase it failed in and whether the request
    # rode a reused keep-alive connection (``kvmesh_tools.replay.errors``); None otherwise.
    error_detail: dict | None = None

    @property
    def reused(self) -> int:
        """The request's hit: prompt tokens no engine computed for it."""
        return self.cached if self.reused_tokens is None else self.reused_tokens


@dataclass
class Call:
    request_id: str
    tokens: list[int]
    max_tokens: int
    session_id: str
    policy: str = ""


class GrpcTransport:
    def __init__(self, target: str, model: str, timeout_s: float, tls: TlsConfig | None = None,
                 api_key: str = "") -> None:
        self.target = target
        self.model = model
        self.timeout_s = timeout_s
        self.channel = aio_channel(target, tls=tls)
        self.stub = router_pb2_grpc.RouterStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None

    async def models(self) -> list[str]:
        try:
            resp = await self.stub.ListModels(router_pb2.ListModelsRequest(), timeout=self.timeout_s,
                                              metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:   # a wrong key, TLS refused, no router: say which, no traceback
            raise RuntimeError(f"router at {self.target} refused ListModels: {exc.code().name}: {exc.details()}"
                               ) from None
        return [m.id for m in resp.models]

    async def call(self, c: Call) -> Outcome:
        out = Outcome(sent=time.monotonic(), prompt_tokens=len(c.tokens))
        req = router_pb2.GenerateRequest(
            request_id=c.request_id, model=self.model, tokens=common_pb2.TokenIds(ids=c.tokens),
            sampling=common_pb2.SamplingParams(max_tokens=c.max_tokens, ignore_eos=True, temperature=0.0),
            session_id=c.session_id, policy=c.policy)
        try:
            async for msg in self.stub.Generate(req, timeout=self.timeout_s, metadata=self.metadata):
                now = time.monotonic()
                if msg.HasField("chunk"):
                    if msg.chunk.token_ids:
                        if out.first_token is None:
                            out.first_token = now
                        out.chunk_times.append(now)
                        out.output_tokens += len(msg.chunk.token_ids)
                else:
                    f = msg.final
                    out.finish = now
                    u = f.usage
                    out.prompt_tokens = u.prompt_tokens or out.prompt_tokens
                    out.output_tokens = u.completion_tokens or out.output_tokens
                    out.cached, out.cached_gpu, out.cached_offload = (u.cached_tokens, u.cached_tokens_gpu,
                                                                      u.cached_tokens_offload)
                    out.predicted = f.routing.predicted_cached_tokens
                    out.endpoint = f.routing.endpoint
                    out.split = f.routing.split
                    out.reused_tokens, out.transferred = f.routing.reused_tokens, f.routing.transferred_tokens
                    out.moved, out.given_up = f.routing.moved, f.routing.given_up_tokens
                    out.mismatch = f.routing.mismatch
                    out.decision_ms, out.lookup_ms = f.routing.decision_ms, f.routing.lookup_ms
                    out.engine_ttft_s = f.ttft_s or None
        except grpc.aio.AioRpcError as exc:
            out.error = f"{exc.code().name}: {exc.details()}"
        if out.finish is None and not out.error:
            out.error = "stream ended without a final message"
        return out

    async def close(self) -> None:
        await self.channel.close()


class HttpTransport:
    """OpenAI ``/v1/completions`` with a token-id prompt, streamed, usage included."""

    def __init__(self, base_url: str, model: str, timeout_s: float, api_key: str = "") -> None:
        self.base = base_url.rstrip("/")
        self.model = model
        # Idle connections are reused for 30 s (httpx: 5 s), well inside the router's 65 s. A client
        # short of CPU can take seconds between taking a pooled connection and sending on it;
        # with 5 s the pool's expiry closed connections under such requests (ReadError <-
        # ClosedResourceError: the client's own close, in a 200-session soak at load ~10).
        self.client = httpx.AsyncClient(timeout=timeout_s,
                                        limits=httpx.Limits(max_connections=1024, keepalive_expiry=30.0),
                                        headers={"authorization": f"Bearer {api_key}"} if api_key else None)

    async def models(self) -> list[str]:
        try:
            r = await self.client.get(f"{self.base}/v1/models")
            r.raise_for_status()
        except httpx.HTTPStatusError as exc:
            raise RuntimeError(f"router at {self.base}: GET /v1/models answered {exc.response.status_code}: "
                               f"{exc.response.text[:200]}") from None
        except httpx.HTTPError as exc:
            raise RuntimeError(f"router at {self.base}: GET /v1/models failed: {summary(exc)}") from None
        return [m["id"] for m in r.json().get("data", [])]

    async def call(self, c: Call) -> Outcome:
        out = Outcome(sent=time.monotonic(), prompt_tokens=len(c.tokens))
        body = {"model": self.model, "prompt": c.tokens, "max_tokens": c.max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 0.0, "ignore_eos": True,
                "session_id": c.session_id}
        if c.policy:
            body["kvmesh_policy"] = c.policy
        # Where the request is, from httpcore's trace events: a failure then says whether it
        # died connecting, sending, waiting for the response's headers or reading its body, and
        # whether the connection was a reused keep-alive one (no connect event).
        where: dict = {"phase": "pool", "new_connection": False, "status": None, "events": 0, "timeline": {}}

        async def trace(event: str, info: dict) -> None:
            phase = phase_of(event)
            if phase is not None:
                where["phase"] = phase
                # When each phase began (s after the call): a slow client, a slow connect and
                # a slow server answer look alike in the phase alone.
                where["timeline"].setdefault(phase, round(time.monotonic() - out.sent, 3))
                if phase == "connect":
                    where["new_connection"] = True

        try:
            async with self.client.stream("POST", f"{self.base}/v1/completions", json=body,
                                          extensions={"trace": trace}) as r:
                where["status"] = r.status_code
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")[:300]
                    out.error = f"HTTP {r.status_code}: {text}"
                    return out
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    where["events"] += 1
                    data = line[6:]
                    if data == "[DONE]":
                        # Read on to the end of the body, as OpenAI's SDK does: a response left
                        # unread (the chunked body's last chunk) makes httpx close the connection
                        # instead of reusing it, so every request would open a new one.
                        continue
                    doc = json.loads(data)
                    now = time.monotonic()
                    if "error" in doc:
                        out.error = str(doc["error"].get("message"))
                        continue
                    for ch in doc.get("choices") or []:
                        n = len(ch.get("token_ids") or [])
                        if n:
                            if out.first_token is None:
                                out.first_token = now
                            out.chunk_times.append(now)
                            out.output_tokens += n
                    if doc.get("kvmesh"):
                        k = doc["kvmesh"]
                        out.predicted = k.get("predicted_cached_tokens")
                        out.endpoint = k.get("endpoint", "")
                        out.split = bool(k.get("split"))
                        out.reused_tokens, out.transferred = k.get("reused_tokens"), k.get("transferred_tokens", 0)
                        out.moved, out.given_up = bool(k.get("moved")), int(k.get("given_up_tokens") or 0)
                        out.mismatch = k.get("mismatch", "")
                        out.decision_ms, out.lookup_ms = k.get("decision_ms"), k.get("lookup_ms")
                    if doc.get("usage"):
                        u = doc["usage"]
                        d = u.get("prompt_tokens_details") or {}
                        out.prompt_tokens = u.get("prompt_tokens", out.prompt_tokens)
                        out.output_tokens = u.get("completion_tokens", out.output_tokens)
                        out.cached = d.get("cached_tokens", 0)
                        out.cached_gpu = d.get("cached_tokens_gpu", 0)
                        out.cached_offload = d.get("cached_tokens_offload", 0)
                        out.finish = now
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            out.error = summary(exc)
            out.error_detail = {**describe_error(exc), "phase": where["phase"],
                                "new_connection": where["new_connection"], "status": where["status"],
                                "timeline": where["timeline"],
                                "sse_events": where["events"], "tokens": out.output_tokens,
                                "elapsed_s": round(time.monotonic() - out.sent, 3)}
        if out.finish is None and not out.error:
            out.error = "stream ended without usage"
        return out

    async def close(self) -> None:
        await self.client.aclose()
