"""The prefill half of a P/D split onto external vLLM engines, shared by both front doors.

llm-d's P/D sidecar convention with kvmesh's store as the KV transport instead of NIXL: the
prefill engine gets the request with ``max_tokens`` 1, no stream and ``kv_transfer_params``
``{"kvmesh": {"prefill_only": true}}``, and its ``KvmeshConnector`` saves the prompt's blocks
to the store. The connector saves in the background, so an answer from the prefill engine does
not mean the store has the blocks yet: the store's KV events (through the indexer) say when it
does, and only then is the decode engine asked, so its connector restores the prefix instead
of computing it.

The HTTP front door (``passthrough``) sends the client's body this way; gRPC ``Generate``
(``RouterService``) sends its completions request of token ids. Either way a failed prefill
only costs the split: the decode engine computes the prompt.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx

from kvmesh.routing.router import prefill_request_id
from kvmesh.routing.scoring import max_hit_blocks
from kvmesh_api.common.v1 import common_pb2
from kvmesh_router.engine_usage import EngineUsage
from kvmesh_router.openai_endpoint import CONNECT_ERRORS

log = logging.getLogger(__name__)


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill engine's request: one token, no stream, and the connector told to save the prompt."""
    b = dict(body)
    b["stream"] = False
    b.pop("stream_options", None)
    if "max_completion_tokens" in b:
        b["max_completion_tokens"] = 1
    b["max_tokens"] = 1
    if "n" in b:
        b["n"] = 1
    b["kv_transfer_params"] = {"kvmesh": {"prefill_only": True}}
    return b


def prefill_body(body: dict[str, Any]) -> bytes:
    """``prefill_request`` as the bytes to send."""
    return json.dumps(prefill_request(body), ensure_ascii=False).encode()


@dataclass(frozen=True)
class Prefilled:
    """A prefill that ran: the prompt's blocks the store then holds, and the prompt tokens the
    prefill engine found cached (the split's reuse), None when its answer does not say (vLLM
    reports them with ``--enable-prompt-tokens-details``)."""

    held_blocks: int
    cached_tokens: int | None

    def usage(self) -> common_pb2.Usage | None:
        """The prefill engine's count as the usage ``RouterService.count_reuse`` reads (an
        external engine names no tier: the GPU's), None when it reported none."""
        if self.cached_tokens is None:
            return None
        return common_pb2.Usage(cached_tokens=self.cached_tokens, cached_tokens_gpu=self.cached_tokens)


def answer_cached_tokens(r: httpx.Response) -> int | None:
    """The cached prompt tokens a non-streamed answer reports, or None."""
    usage = EngineUsage()
    usage.from_json(r.content)
    return usage.cached_tokens


async def prefill(cluster: Any, load: Any, cfg: Any, request_id: str, keys: Any, num_tokens: int, block_size: int,
                  prompt_len: int, eid: str, path: str, content: bytes, headers: dict[str, str],
                  deadline: float | None) -> Prefilled | None:
    """Run the prompt on the external prefill engine ``eid`` and wait until the store holds its
    KV; None when the prefill failed.

    ``cluster`` is the router's ``Cluster`` (engines, index lookups), ``load`` its load view
    (the prefill counts on the prefill engine while it runs), ``cfg`` its ``RouterConfig``.
    """
    ext = cluster.external
    url = ext.urls.get(eid)
    if url is None:
        return None
    rid = prefill_request_id(request_id)
    load.on_sent(eid, rid, prompt_len, time.monotonic())
    left = None if deadline is None else max(0.001, deadline - time.monotonic())
    try:
        r = await ext.client.post(url + path, content=content,
                                  headers={**headers, "x-request-id": rid, **ext.rank_headers(eid)},
                                  timeout=httpx.Timeout(left, connect=cfg.external_connect_timeout_s))
    except httpx.HTTPError as exc:
        if isinstance(exc, CONNECT_ERRORS):
            cluster.mark_dead(eid, f"{type(exc).__name__}: {exc}")
        log.warning("prefill engine failed; the decode engine computes the prompt",
                    extra={"request_id": request_id, "endpoint": eid, "error": f"{type(exc).__name__}: {exc}"})
        return None
    finally:
        load.on_finished(rid)
    if r.status_code != 200:
        log.warning("prefill engine refused; the decode engine computes the prompt",
                    extra={"request_id": request_id, "endpoint": eid, "status": r.status_code,
                           "body": r.text[:500]})
        return None
    # The connector saves in the background: the store's KV events say when it is there.
    want = max_hit_blocks(num_tokens, block_size)
    until = time.monotonic() + cfg.split_store_wait_s
    if deadline is not None:
        until = min(until, deadline)
    held, pause = 0, 0.01
    while True:
        m = await cluster.lookup(keys)
        if m is not None and m.source != "local":
            held = min(max(m.store.cpu, m.store.disk), want)
        if held >= want or time.monotonic() >= until:
            break
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.1)
    if held < want:
        log.warning("the store holds part of the prefilled prompt", extra={
            "request_id": request_id, "endpoint": eid, "held_blocks": held, "wanted_blocks": want})
    return Prefilled(held, answer_cached_tokens(r))
