"""Token-id generation on an external vLLM: gRPC ``Generate`` through vLLM's ``/v1/completions``.

A kvmesh worker takes token ids and streams token ids back; a plain ``vllm serve`` has no
such API, but its completions endpoint takes a prompt of token ids and, with
``return_token_ids``, puts each streamed delta's ids into the chunk (``choices[0].token_ids``).
So the router's own token path (gRPC ``Generate``, and anything else that goes through
``RouterService.generate``) reaches external engines as one streamed completions request:
the prompt the router hashed, the tenant's ``cache_salt``, the sampling parameters the
proto carries, and ``stream_options.include_usage`` so the final chunk says how many prompt
tokens vLLM found cached (``--enable-prompt-tokens-details``).

This module only speaks HTTP and SSE; ``RouterService`` decides retries and accounting from
the exceptions: ``NoAnswer`` before any token (another endpoint may serve it), ``Rejected``
when the engine refused the request itself (its status and message pass through).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvmesh.sampling import knobs_of
from kvmesh_api.common.v1 import common_pb2
from kvmesh_router.openai_endpoint import CONNECT_ERRORS

# A connection that closed before an answer: nothing is known of the endpoint's health.
_NO_ANSWER = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
# Statuses that say "not now" rather than "not this request": another endpoint may serve it.
_BUSY = {429, 500, 502, 503, 504}
_FINISH = {"length": common_pb2.FINISH_REASON_LENGTH, "stop": common_pb2.FINISH_REASON_STOP}
# An error body's message is cut here: it goes into a gRPC status.
_MAX_MESSAGE = 2000


class NoAnswer(Exception):
    """The engine gave no answer; ``mark_dead`` when it could not even be connected to."""

    def __init__(self, why: str, mark_dead: bool) -> None:
        super().__init__(why)
        self.why = why
        self.mark_dead = mark_dead


class Rejected(Exception):
    """The engine answered the request with an error status (its own validation)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Broken(Exception):
    """The stream failed after it began (connection lost, an error event, silence)."""


class Deadline(Exception):
    """The request's deadline passed before the stream ended."""


@dataclass
class Completion:
    """What the stream said by its end."""

    finish_reason: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    usage_seen: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def request_body(model: str, tokens: Any, sampling: common_pb2.SamplingParams, max_tokens: int,
                 cache_salt: str) -> dict[str, Any]:
    """The completions request for a prompt of token ids and the proto's sampling parameters."""
    body: dict[str, Any] = {"model": model, "prompt": list(tokens), "max_tokens": max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, "return_token_ids": True}
    if sampling.HasField("temperature"):
        body["temperature"] = sampling.temperature
    if sampling.HasField("top_p"):
        body["top_p"] = sampling.top_p
    if sampling.HasField("seed"):
        body["seed"] = sampling.seed
    if sampling.stop:
        body["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        body["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.ignore_eos:
        body["ignore_eos"] = True
    body.update(knobs_of(sampling))
    if sampling.structured_outputs_json:
        body["structured_outputs"] = json.loads(sampling.structured_outputs_json)
    if cache_salt:
        body["cache_salt"] = cache_salt
    return body


def _error_message(raw: bytes) -> str:
    try:
        doc = json.loads(raw)
    except ValueError:
        return raw[:_MAX_MESSAGE].decode(errors="replace")
    err = doc.get("error", doc) if isinstance(doc, dict) else doc
    msg = err.get("message") if isinstance(err, dict) else None
    return str(msg if msg is not None else doc)[:_MAX_MESSAGE]


async def stream_tokens(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str],
                        connect_timeout_s: float, first_token_timeout_s: float, idle_timeout_s: float,
                        done: Completion, deadline: float | None = None) -> AsyncIterator[list[int]]:
    """Yield each chunk's generated token ids; ``done`` holds the finish reason and usage at the end.

    Raises ``NoAnswer`` / ``Rejected`` before the first token, ``Broken`` after it, ``Deadline``
    past ``deadline`` (``time.monotonic()``); ``TimeoutError`` never escapes (silence is
    ``NoAnswer`` or ``Broken``). Timeouts are per read, never across a yield: the consumer may
    resume this generator from another task (the router's hedging does).
    """
    left = None if deadline is None else max(0.001, deadline - time.monotonic())
    req = client.build_request("POST", url + "/v1/completions", json=body, headers=headers,
                               timeout=httpx.Timeout(left, connect=min(connect_timeout_s, left or connect_timeout_s)))
    try:
        resp = await client.send(req, stream=True)
    except CONNECT_ERRORS as exc:
        raise NoAnswer(f"{type(exc).__name__}: {exc}", mark_dead=True) from None
    except _NO_ANSWER as exc:
        raise NoAnswer(f"{type(exc).__name__}: {exc}", mark_dead=False) from None
    started = False
    try:
        if resp.status_code != 200:
            raw = await resp.aread()
            if resp.status_code in _BUSY:
                raise NoAnswer(f"HTTP {resp.status_code}: {_error_message(raw)}", mark_dead=False)
            raise Rejected(resp.status_code, _error_message(raw))
        lines = resp.aiter_lines()
        while True:
            limit = idle_timeout_s if started else first_token_timeout_s
            wait = limit or None
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Deadline()
                wait = left if wait is None else min(wait, left)
            try:
                if wait is not None:
                    async with asyncio.timeout(wait):
                        line = await anext(lines)
                else:
                    line = await anext(lines)
            except StopAsyncIteration:
                break
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise Deadline() from None
                if started:
                    raise Broken(f"silent for {limit:g}s") from None
                raise NoAnswer(f"STALLED: no token within {limit:g}s", mark_dead=False) from None
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            try:
                ev = json.loads(line[6:])
            except ValueError:
                raise Broken(f"not an SSE JSON event: {line[:200]!r}") from None
            if not isinstance(ev, dict):
                continue
            if "error" in ev:
                msg = _error_message(line[6:].encode())
                if started:
                    raise Broken(msg)
                raise Rejected(400, msg)
            usage = ev.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
                done.usage_seen = True
                done.prompt_tokens = usage["prompt_tokens"]
                done.completion_tokens = int(usage.get("completion_tokens") or 0)
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                done.cached_tokens = cached if isinstance(cached, int) else 0
            for choice in ev.get("choices") or []:
                ids = choice.get("token_ids")
                if ids:
                    started = True
                    yield list(ids)
                reason = choice.get("finish_reason")
                if reason:
                    done.finish_reason = _FINISH.get(reason, common_pb2.FINISH_REASON_STOP)
        if not done.finish_reason:
            if started:
                raise Broken("the stream ended without a finish reason")
            raise NoAnswer("the stream ended without an answer", mark_dead=False)
    except httpx.TimeoutException as exc:
        if deadline is not None and time.monotonic() >= deadline - 0.01:
            raise Deadline() from None
        if started:
            raise Broken(f"{type(exc).__name__}: {exc}") from None
        raise NoAnswer(f"{type(exc).__name__}: {exc}", mark_dead=isinstance(exc, httpx.ConnectTimeout)) from None
    except httpx.HTTPError as exc:
        if started:
            raise Broken(f"{type(exc).__name__}: {exc}") from None
        raise NoAnswer(f"{type(exc).__name__}: {exc}", mark_dead=False) from None
    finally:
        await resp.aclose()
