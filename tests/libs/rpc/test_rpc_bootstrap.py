"""The shared gRPC bootstrap: health transitions, reflection, SIGTERM drain."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvmesh_tools.testing.procs import wait_for_serving
from tests.helpers.slow_server import SERVICE, make_server
from tests.paths import REPO


async def _check(ch: grpc.aio.Channel, service: str) -> int:
    resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
    return resp.status


async def test_health_readiness_and_liveness_transitions() -> None:
    srv = make_server()
    port = await srv.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            assert await _check(ch, "") == health_pb2.HealthCheckResponse.NOT_SERVING
            assert await _check(ch, SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
            assert await _check(ch, "liveness") == health_pb2.HealthCheckResponse.SERVING
            await srv.set_ready(True)
            assert await _check(ch, "") == health_pb2.HealthCheckResponse.SERVING
            assert await _check(ch, SERVICE) == health_pb2.HealthCheckResponse.SERVING
            await srv.set_ready(False)
            assert await _check(ch, "") == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        await srv.stop(0)


async def test_reflection_lists_services() -> None:
    srv = make_server()
    port = await srv.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            call = stub.ServerReflectionInfo()
            await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            resp = await call.read()
            await call.done_writing()
            names = {s.name for s in resp.list_services_response.service}
        assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
    finally:
        await srv.stop(0)


async def test_bind_first_then_add_services_and_start() -> None:
    """``bind`` on port 0 returns the kernel's port before any servicer exists (a worker names
    its endpoint after it); services added afterwards are served on that same port."""
    from kvmesh.rpc.server import ServerOptions, ServiceServer
    from tests.helpers.slow_server import _binding

    srv = ServiceServer("bind-first", [], ServerOptions(host="127.0.0.1", port=0, grace_s=1))
    port = await srv.bind()
    assert port > 0 and await srv.bind() == port
    srv.bindings.append(_binding())
    try:
        assert await srv.start() == port
        await srv.set_ready(True)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            assert await _check(ch, SERVICE) == health_pb2.HealthCheckResponse.SERVING
            assert await ch.unary_unary(f"/{SERVICE}/Sleep")(b"0", timeout=10) == b"done"
    finally:
        await srv.stop(0)


async def test_a_bound_server_never_started_releases_its_port() -> None:
    import socket

    from kvmesh.rpc.server import ServerOptions, ServiceServer

    srv = ServiceServer("bound-only", [], ServerOptions(host="127.0.0.1", port=0, grace_s=1))
    port = await srv.bind()
    await srv.stop(0)
    # Nothing listens there any more (a connect is refused; binding the port ourselves could
    # race an unrelated socket the kernel hands the same ephemeral port).
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.settimeout(10)
        s.connect(("127.0.0.1", port))


def test_sigterm_drains_in_flight_calls() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.slow_server"], cwd=REPO, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        line = proc.stdout.readline()   # "PORT <n>" once it listens on the port the kernel gave it
        assert line.startswith("PORT "), line
        port = int(line.split()[1])
        wait_for_serving(f"127.0.0.1:{port}", timeout_s=30, proc=proc)
        result: dict[str, object] = {}

        def call() -> None:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                fn = ch.unary_unary(f"/{SERVICE}/Sleep")
                try:
                    result["value"] = fn(b"1.5", timeout=10)
                except grpc.RpcError as exc:
                    result["error"] = exc.code()

        t = threading.Thread(target=call)
        t.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        # Readiness drops at once, while the in-flight call is still running.
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            try:
                st = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
                assert st == health_pb2.HealthCheckResponse.NOT_SERVING
            except grpc.RpcError as exc:  # the listener may already be closed to new calls
                assert exc.code() == grpc.StatusCode.UNAVAILABLE
        t.join(10)
        assert result.get("value") == b"done", result
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("bad", ["abc", "1.5x"])
def test_config_error_names_setting(bad: str) -> None:
    from dataclasses import dataclass, field

    from kvmesh.config import ConfigError, load_config

    @dataclass
    class Cfg:
        port: int = field(default=1, metadata={"help": "p"})

    with pytest.raises(ConfigError, match="port"):
        load_config(Cfg, env={"KVMESH_PORT": bad})
