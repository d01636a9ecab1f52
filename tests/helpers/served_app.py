"""An ASGI app served by uvicorn on a loopback port of its own (port 0: the kernel's pick, no race).

For tests that need a real HTTP connection: httpx's ASGI transport runs a response to its end before
the client sees a byte, so a stream that waits on the test cannot be read as it goes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn


@asynccontextmanager
async def served(app: Any) -> AsyncIterator[str]:
    """The app's base URL (``http://127.0.0.1:PORT``) while the block runs."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
