"""Run a service's async main under asyncio with signal-driven graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from kvmesh.config import ConfigError

log = logging.getLogger(__name__)


def run_async_main(main: Callable[[], Awaitable[int | None]]) -> int:
    """Run ``main`` to completion; a ``ConfigError`` exits 2 with its message."""
    try:
        return int(asyncio.run(main()) or 0)
    except ConfigError as exc:
        log.error("bad configuration: %s", exc)
        return 2
    except KeyboardInterrupt:
        return 130
