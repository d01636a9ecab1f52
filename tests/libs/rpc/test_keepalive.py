"""Clients' keepalive pings and servers' ping policy agree: an idle channel is never GOAWAY'd.

Seen in the field: clients pinged every 20 s, servers (gRPC's defaults) accepted one ping per
5 minutes, and connections died with ``GOAWAY too_many_pings``. The numbers are scaled down
here (client pings every 300 ms) so the test runs in seconds; a control server with gRPC's
defaults shows the test can fail.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvmesh.rpc.channel import channel_options
from kvmesh.rpc.keepalive import CLIENT_KEEPALIVE_MS, server_keepalive_options

PING_MS = 300


def test_server_accepts_pings_at_least_as_often_as_clients_send_them() -> None:
    client = dict(channel_options())
    server = dict(server_keepalive_options())
    assert client["grpc.keepalive_time_ms"] == CLIENT_KEEPALIVE_MS
    assert server["grpc.http2.min_recv_ping_interval_without_data_ms"] < client["grpc.keepalive_time_ms"]
    assert server["grpc.keepalive_permit_without_calls"] == client["grpc.keepalive_permit_without_calls"] == 1


async def _idle_channel_state(server_options: list[tuple[str, object]]) -> grpc.ChannelConnectivity:
    server = grpc.aio.server(options=server_options)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options(keepalive_ms=PING_MS)) as ch:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            await asyncio.sleep(PING_MS * 12 / 1000)   # idle: only keepalive pings cross
            return ch.get_state()
    finally:
        await server.stop(0)


@pytest.mark.timeout(60)
async def test_an_idle_channel_stays_connected_under_kvmesh_server_options() -> None:
    assert await _idle_channel_state(server_keepalive_options(PING_MS)) == grpc.ChannelConnectivity.READY


@pytest.mark.timeout(60)
async def test_control_grpc_default_server_goaways_the_pinging_client() -> None:
    assert await _idle_channel_state([]) != grpc.ChannelConnectivity.READY
