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
"""

from __future__ import annotations

from urllib.parse import urlsplit

import httpx

from kvmesh.config import ConfigError
from kvmesh.routing.load import LoadReport
from kvmesh_router.engine_metrics import parse_vllm_metrics

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

    def __init__(self, connect_timeout_s: float = 2.0, api_key: str = "") -> None:
        self.urls: dict[str, str] = {}
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

    async def load(self, eid: str, model: str, timeout_s: float) -> LoadReport:
        """The endpoint's load now; raises a ``CONNECT_ERRORS`` if it is not there, else
        ``httpx.HTTPError`` or ``MetricsError``."""
        r = await self.client.get(self.urls[eid] + "/metrics",
                                  timeout=httpx.Timeout(timeout_s, connect=self.connect_timeout_s))
        r.raise_for_status()
        return parse_vllm_metrics(r.text, model)

    async def aclose(self) -> None:
        await self.client.aclose()
