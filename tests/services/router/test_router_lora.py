"""LoRA requests on engine KV events: the router hashes with the adapter path each worker reports.

vLLM puts ``("lora", name, path)`` into every block hash, so the router must learn
the path each endpoint loaded (``GetInfo.lora_paths``) or its keys never match the
engine's events. The sim workers here hash LoRA blocks with their configured path,
exactly as vLLM would for the same adapter path.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import pytest

from kvmesh.hashing import BlockHasher, ExtraKeys
from kvmesh.routing.router import RouterCore, RouterCoreConfig
from kvmesh_api.router.v1 import router_pb2
from kvmesh_tools.testing.procs import ServiceProcess
from tests.fixtures.router import (
    BLOCK,
    MODEL,
    RouterStack,
    rand_tokens,
    start_indexer,
    start_router,
    start_worker,
)

pytestmark = pytest.mark.timeout(150)

PATH_A = "/adapters/ad1-v1"
PATH_B = "/adapters/ad1-v2"


@pytest.fixture(scope="module")
def lstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterStack]:
    tmp = tmp_path_factory.mktemp("router-lora")
    started: list[ServiceProcess] = []
    try:
        idx = start_indexer(tmp)
        started.append(idx)
        # w1 loads ad1 from one path, w2 from another: the router must hash per path.
        for eid, path in (("w1", PATH_A), ("w2", PATH_B)):
            started.append(start_worker(tmp, eid, indexer=idx.grpc_address, wait=False,
                                        extra=["--lora-paths", f'{{"ad1": "{path}"}}']))
        for p in started[1:]:
            p.wait_ready(90)
        # No static lora_modules: the paths come from each worker's GetInfo.
        router, http = start_router(tmp, [], indexer=idx.grpc_address,
                                    extra=["--speculative-ttl-s", "0.1", "--indexer-speculative", "false"])
        started.append(router)
        st = RouterStack(router, http, {"w1": started[1], "w2": started[2]}, idx)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            models = st.stub.ListModels(router_pb2.ListModelsRequest(), timeout=5).models
            if models and len(models[0].endpoints) >= 2:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("router did not discover the workers")
        yield st
        st.close()
    finally:
        for p in reversed(started):
            p.stop(grace_s=3)








def test_lora_second_turn_prediction_equals_engine_hit(lstack):
    tokens = rand_tokens(700, 7)
    out, first = lstack.generate(tokens, lora_name="ad1", session_id="lora-s")
    holder = first.routing.endpoint
    path = PATH_A if holder == "w1" else PATH_B
    # The engine hashed with its own adapter path (as vLLM does): its events carry these keys.
    keys = BlockHasher("sha256_cbor", BLOCK).block_keys(tokens[:BLOCK * 2], ExtraKeys(lora_name="ad1",
                                                                                       lora_path=path))
    lstack.wait_indexed(holder, keys=keys)
    time.sleep(0.4)   # past the speculative TTL: the prediction rests on engine events alone
    tokens = tokens + out + rand_tokens(80, 8)
    _, second = lstack.generate(tokens, lora_name="ad1", session_id="lora-s")
    r = second.routing
    assert r.endpoint == holder
    assert second.usage.cached_tokens >= 640
    assert r.predicted_cached_tokens == second.usage.cached_tokens, (r, second.usage)


def test_same_prompt_without_lora_or_other_path_is_not_a_hit(lstack):
    tokens = rand_tokens(500, 9)
    _, a = lstack.generate(tokens, lora_name="ad1")
    time.sleep(0.4)
    _, base = lstack.generate(tokens)
    if base.routing.endpoint == a.routing.endpoint:
        assert base.usage.cached_tokens == 0
    assert base.routing.predicted_cached_tokens == base.usage.cached_tokens


def test_unknown_adapter_is_rejected_with_its_name(lstack):
    with pytest.raises(grpc.RpcError) as exc:
        lstack.generate([1, 2, 3], lora_name="nope")
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nope" in exc.value.details()


def test_lora_groups_split_by_path_and_static_config_fills_unknown_endpoints():
    from kvmesh_router.cluster import Cluster
    from kvmesh_router.config import RouterConfig

    async def run() -> None:
        cfg = RouterConfig(model=MODEL, block_size=BLOCK, lora_modules={"ad1": "/static"},
                           endpoints=["a=127.0.0.1:1", "b=127.0.0.1:2", "c=127.0.0.1:3", "d=127.0.0.1:4"])
        cl = Cluster(cfg, RouterCore(RouterCoreConfig(block_size=BLOCK)))
        cl.lora_paths.update({"a": {"ad1": "/p1"}, "b": {"ad1": "/p1"}, "c": {"other": "/x"}})
        groups, lacking = cl.lora_groups("ad1")
        # GetInfo wins over static config; d (no info) falls back to it; c doesn't serve ad1.
        assert groups == {"/p1": {"a", "b"}, "/static": {"d"}} and lacking == {"c"}
        assert cl.knows_lora("other") and cl.knows_lora("ad1") and not cl.knows_lora("zzz")
        await cl.stop()

    asyncio.run(run())
