"""How an HTTP request that fails before its answer ends: one rule for every handler.

Why it exists: the router's own path (``http_api``) and the external-engine path
(``passthrough``, OpenAI and Anthropic bodies) end the same ways: a ``RouterError`` becomes its
JSON error and counts in ``kvmesh_router_requests_total{api, outcome=<error class>}``; a client
that went away (the disconnect watch cancelled the worker calls) gets 499 and counts as
``client_gone``; a cancel for any other reason propagates. The disconnect watch stops in every
case. ``shape`` (``passthrough.Shape``) writes the error in its API's shape; none: OpenAI's.

The endpoints of stored state (``/v1/responses/{id}``..., ``/v1/conversations``...) end one way of
their own (``store_route``): a refused request (``OpenAIError``) is its error, a store that cannot
answer is a 503, and each counts by its status.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.responses import Response

from kvmesh.openai.errors import OpenAIError, error_response
from kvmesh.responses_api.history import unavailable
from kvmesh.responses_api.store.base import StoreError
from kvmesh_router import metrics
from kvmesh_router.errors import RouterError

_STORE_OUTCOMES = {400: "BadRequest", 404: "NotFound", 413: "TooLarge", 503: "StoreUnavailable"}


def router_error_response(exc: RouterError, api: str, shape: Any = None) -> Response:
    """``exc`` as its API's error body with its status, counted under ``api``."""
    metrics.REQUESTS.labels(api=api, outcome=type(exc).__name__).inc()
    if shape is not None:
        return shape.router_error(exc)
    return error_response(exc.http_status, exc.message, exc.error_type, exc.param)


async def answer_or_error(api: str, watch: Any, answer: Awaitable[Response], shape: Any = None) -> Response:
    """``answer``'s response, or the response for how it failed (module docstring); stops ``watch``."""
    try:
        return await answer
    except RouterError as exc:
        return router_error_response(exc, api, shape)
    except asyncio.CancelledError:
        if not watch.gone:
            raise
        metrics.REQUESTS.labels(api=api, outcome="client_gone").inc()
        if shape is not None:
            return shape.error(499, "client closed the request", "client_closed")
        return error_response(499, "client closed the request", "client_closed")
    finally:
        watch.stop()


def store_route(api: str, fn: Callable[..., Awaitable[Response]],
                off: Callable[..., OpenAIError] | None = None) -> Callable[..., Awaitable[Response]]:
    """``fn`` (a handler of stored state) answering its ``OpenAIError`` and the store's ``StoreError``
    (503) in OpenAI's shape, counted under ``api`` by outcome; with ``off`` (no store configured)
    every call is the error ``off`` makes of the route's path parameters. FastAPI reads the route's parameters through ``functools.wraps``."""
    @functools.wraps(fn)
    async def handler(*args: Any, **kw: Any) -> Response:
        try:
            if off is not None:
                raise off(**kw)
            out = await fn(*args, **kw)
        except StoreError as exc:
            out = unavailable(exc).response()
        except OpenAIError as exc:
            out = exc.response()
        status = out.status_code
        metrics.REQUESTS.labels(api=api, outcome="ok" if status < 400 else _STORE_OUTCOMES.get(
            status, f"http_{status}")).inc()
        return out
    return handler
