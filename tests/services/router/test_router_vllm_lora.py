"""A LoRA request through the router to real vLLM: the turn-2 prediction equals vLLM's cached tokens.

vLLM hashes ``("lora", name, path)`` into every block. The router has no static
``lora_modules`` here: it must learn the adapter path from the worker's
``GetInfo.lora_paths``, or its keys never match vLLM's KV events.
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
def lora_router(vllm_workers, tiny_lora_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("router-vllm-lora")
    idx = ServiceProcess.with_ports("indexer", lambda iport: [
        "--host", "127.0.0.1", "--port", str(iport), "--models", f"{TINY_MODEL_NAME}@32@sha256_cbor",
        "--default-model", TINY_MODEL_NAME], log_path=tmp / "indexer.log").start(60)
    router = None
    try:
        vllm_workers([{"name": "vllm-lora", "kv_cache_bytes": 8 << 20, "max_model_len": 2048,
                       "vllm_options": {"lora_modules": {"ad1": str(tiny_lora_dir)}, "max_lora_rank": 8},
                       "extra": ["--indexer-address", idx.grpc_address, "--heartbeat-s", "0.5"]}])
        router = ServiceProcess.with_ports("router", lambda port: [
            "--host", "127.0.0.1", "--port", str(port), "--http-port", "0", "--auth", "off",
            "--model", TINY_MODEL_NAME, "--block-size", "32", "--hash-algo", "sha256_cbor", "--indexer",
            idx.grpc_address, "--registry-poll-s", "0.2", "--speculative-ttl-s", "0.2",
            "--indexer-speculative", "false", "--max-model-len", "2048"], log_path=tmp / "router.log").start(60)
        with grpc.insecure_channel(router.grpc_address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            deadline = time.monotonic() + 60
            eps: list[str] = []
            while time.monotonic() < deadline:
                models = stub.ListModels(router_pb2.ListModelsRequest(), timeout=5).models
                eps = list(models[0].endpoints) if models else []
                if eps:
                    break
                time.sleep(0.2)
            assert eps, "router did not discover the vLLM worker"
        yield router.grpc_address
    finally:
        if router is not None:
            router.stop(grace_s=5)
        idx.stop(grace_s=5)


def test_lora_turn_two_prediction_equals_vllm_cached_tokens(lora_router):
    rng = random.Random(11)
    tokens = [rng.randrange(500, 31000) for _ in range(300)]
    with grpc.insecure_channel(lora_router) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        finals = []
        for _turn in range(2):
            req = router_pb2.GenerateRequest(
                model=TINY_MODEL_NAME, tokens=common_pb2.TokenIds(ids=tokens), session_id="lora-agent",
                lora_name="ad1", sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            out: list[int] = []
            final = None
            for msg in stub.Generate(req, timeout=120):
                if msg.HasField("chunk"):
                    out.extend(msg.chunk.token_ids)
                else:
                    final = msg.final
            assert final is not None
            finals.append(final)
            tokens = tokens + out + [rng.randrange(500, 31000) for _ in range(50)]
            time.sleep(1.0)   # vLLM's events reach the indexer; past the speculative TTL
    second = finals[1]
    assert second.usage.cached_tokens >= 288
    assert second.routing.predicted_cached_tokens == second.usage.cached_tokens, (second.routing, second.usage)
