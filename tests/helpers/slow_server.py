"""A minimal service on kvmesh's bootstrap with one slow unary method, for drain tests.

Run as a script: ``python -m tests.helpers.slow_server [PORT]``; it prints ``PORT <n>`` once
it listens (port 0, the default, lets the kernel choose: no port is picked before it binds).
"""

from __future__ import annotations

import asyncio
import sys

import grpc

from kvmesh.rpc.server import ServerOptions, ServiceServer

SERVICE = "kvmesh.test.Slow"


def _binding():
    async def sleep(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await asyncio.sleep(float(request.decode() or "1"))
        return b"done"

    handler = grpc.method_handlers_generic_handler(
        SERVICE, {"Sleep": grpc.unary_unary_rpc_method_handler(sleep)}
    )
    return (lambda _servicer, server: server.add_generic_rpc_handlers((handler,)), None, SERVICE)


def make_server(port: int = 0, grace_s: float = 5.0) -> ServiceServer:
    return ServiceServer("slow", [_binding()], ServerOptions(host="127.0.0.1", port=port, grace_s=grace_s))


async def _main(port: int) -> None:
    srv = make_server(port)
    print(f"PORT {await srv.start()}", flush=True)
    srv.install_signal_handlers()
    await srv.set_ready(True)
    await srv.wait()


if __name__ == "__main__":
    asyncio.run(_main(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
