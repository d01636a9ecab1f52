"""External engines: OpenAI-HTTP servers (a plain ``vllm serve``) the router routes to.

They have no kvmesh gRPC API: no ``GetLoad``, ``GetInfo`` or ``Generate``. Their
load comes from vLLM's ``/metrics`` (``engine_metrics``); requests are forwarded
as HTTP (``passthrough``). One ``httpx`` client holds the connection pools of all
of them. Liveness follows the connection, not the metrics page: a refused or
timed-out connect marks the endpoint down (the router routes around it), the
next page read over a working connection brings it back. A page that is slow,
an error status or unparsable leaves the endpoint routable with a stale load
report (the routing core then counts only the router's own requests there),
because a busy engine answering its metrics late is still serving.

A data-parallel server (``--data-parallel-size N``, ``external_dp_size``) is N endpoints,
one per DP rank, named as the indexer names their KV events (``kvmesh.events.topic.dp_endpoint``):
each has the server's URL, is sent vLLM's ``X-data-parallel-rank`` header so the rank the
router scored is the rank that serves, and takes its load from its engine's samples.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import httpx

from kvmesh.config import ConfigError
from kvmesh.routing.load import LoadReport
from kvmesh_router.engine_metrics import parse_vllm_metrics

# vLLM's header naming the DP rank that must serve a request.
DP_RANK_HEADER = "X-data-parallel-rank"
# Connect errors (refused, unreachable, DNS, connect timeout): the server is not there.
CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)


def is_http_address(address: str) -> bool:
    return address.startswith(("http://", "https://"))


def base_url(address: str) -> str:
    """``http://host:port`` (a trailing ``/`` or ``/v1`` dropped); ConfigError if not such a URL."""
    u = urlsplit(address.strip())
    if u.scheme not in ("http", "https") or not u.hostname or u.query or u.fragment:
        raise ConfigError(f"endpoint address {address!r}: expected http://HOST:PORT")
    path = u.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return f"{u.scheme}://{u.netloc}{path}"


class OpenAIEndpoints:
    """Base URLs of the external engines by endpoint id, and the client that talks to them."""

    def __init__(self, connect_timeout_s: float = 2.0, api_key: str = "", dp_size: int = 1) -> None:
        self.urls: dict[str, str] = {}
        self.dp_size = dp_size
        self.ranks: dict[str, tuple[str, int]] = {}   # endpoint id -> (the server's id, DP rank)
        self.connect_timeout_s = connect_timeout_s
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        # Long reads: a streamed answer may take minutes; the caller bounds each request.
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=connect_timeout_s),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
                                        headers=self.headers)

    def __contains__(self, eid: object) -> bool:
        return eid in self.urls

    def __bool__(self) -> bool:
        return bool(self.urls)

    def rank_headers(self, eid: str) -> dict[str, str]:
        """The header that pins a request to the endpoint's DP rank (none for a server of one rank)."""
        if self.dp_size <= 1 or eid not in self.ranks:
            return {}
        return {DP_RANK_HEADER: str(self.ranks[eid][1])}

    def siblings(self, eid: str) -> list[str]:
        """Every endpoint of the server ``eid`` is a rank of (itself included)."""
        base = self.ranks.get(eid, (eid, 0))[0]
        return [e for e, (b, _) in self.ranks.items() if b == base] or [eid]

    async def load(self, eid: str, model: str, timeout_s: float) -> LoadReport:
        """The endpoint's load now; raises a ``CONNECT_ERRORS`` if it is not there, else
        ``httpx.HTTPError`` or ``MetricsError``."""
        r = await self.client.get(self.urls[eid] + "/metrics",
                                  timeout=httpx.Timeout(timeout_s, connect=self.connect_timeout_s))
        r.raise_for_status()
        engine = str(self.ranks[eid][1]) if self.dp_size > 1 and eid in self.ranks else None
        return parse_vllm_metrics(r.text, model, engine=engine)

    async def aclose(self) -> None:
        await self.client.aclose()
