"""How an HTTP request that fails before its answer ends: one rule for every handler.

Why it exists: the router's own path (``http_api``) and the external-engine path
(``passthrough``, OpenAI and Anthropic bodies) end the same ways: a ``RouterError`` becomes its
JSON error and counts in ``kvmesh_router_requests_total{api, outcome=<error class>}``; a client
that went away (the disconnect watch cancelled the worker calls) gets 499 and counts as
``client_gone``; a cancel for any other reason propagates. The disconnect watch stops in every
case. ``shape`` (``passthrough.Shape``) writes the error in its API's shape; none: OpenAI's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from fastapi.responses import Response

from kvmesh.openai.errors import error_response
from kvmesh_router import metrics
from kvmesh_router.errors import RouterError


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
