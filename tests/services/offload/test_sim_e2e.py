"""The offload scenarios end to end on sim workers (real gRPC workers, a real ``kvmesh serve offload``).

1. Request A runs on worker 1; enough other traffic follows to evict A from
   worker 1's KV cache; A then runs on worker 2 (and again on worker 1): both
   restore A's blocks from the store, reported as offload cached tokens.
2. Split: Prefill on a prefill worker writes the KV to the store; a decode
   worker given the handle restores it (kv_from_prefill).
3. Store down: the worker recomputes, the request succeeds, the fallback is counted.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvmesh.hashing import BlockHasher
from kvmesh.kvstore.client import OffloadClient
from kvmesh.kvstore.layout import namespace_for
from kvmesh.worker.config import WorkerConfig
from kvmesh.worker.run import Worker, start_worker
from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.worker.v1 import worker_pb2, worker_pb2_grpc
from kvmesh_tools.testing.ports import free_port

pytestmark = pytest.mark.timeout(90)
BS = 16
NUM_BLOCKS = 24
KV = dict(kv_num_layers=2, kv_num_kv_heads=2, kv_head_dim=32, kv_dtype="bf16")


def _cfg(eid: str, role: str, offload: str) -> WorkerConfig:
    return WorkerConfig(engine="sim", role=role, model="sim-model", endpoint_id=eid, block_size=BS,
                        num_blocks=NUM_BLOCKS, host="127.0.0.1", time_scale=50.0, max_model_len=4096,
                        vocab_size=1000, offload_address=offload, **KV)


@pytest.fixture
def store(offload_process) -> str:
    return offload_process("--ram-capacity-bytes", str(64 << 20)).grpc_address


async def _generate(w: Worker, rid: str, prompt: list[int], **kw) -> worker_pb2.GenerateResponse:
    async with grpc.aio.insecure_channel(w.address) as ch:
        req = worker_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                         sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0), **kw)
        msgs = [m async for m in worker_pb2_grpc.WorkerStub(ch).Generate(req, timeout=30)]
    assert msgs[-1].finished
    return msgs[-1]


def _keys(prompt: list[int]) -> list[int]:
    h = BlockHasher("sha256_cbor", BS)
    return [int.from_bytes(d, "big") & ((1 << 64) - 1) for d in h.block_digests(prompt)]


async def _wait_saved(store: str, prompt: list[int], n: int) -> None:
    ns = namespace_for("sim-model", 2, 2, 32, "bf16", BS)
    async with OffloadClient(store) as c:
        for _ in range(200):
            if await c.contains(ns, _keys(prompt)[:n]) >= n:
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"store never held {n} blocks of the prompt")


async def test_evicted_request_is_restored_from_the_store_on_another_worker(store, workers) -> None:
    w1 = await start_worker(_cfg("w1", "decode", store))
    w2 = await start_worker(_cfg("w2", "decode", store))
    workers += [w1, w2]
    a = list(range(100, 100 + 10 * BS + 3))            # 10 full blocks
    first = await _generate(w1, "a1", a)
    assert first.usage.cached_tokens == 0
    await _wait_saved(store, a, 10)
    # Other traffic fills worker 1's small cache (24 blocks) and evicts A.
    for i in range(3):
        await _generate(w1, f"fill{i}", [(500 + 37 * i + j) % 1000 for j in range(12 * BS)])
    again_w1 = await _generate(w1, "a2", a)
    assert again_w1.usage.cached_tokens_gpu == 0
    assert again_w1.usage.cached_tokens_offload == 10 * BS
    on_w2 = await _generate(w2, "a3", a)
    assert on_w2.usage.cached_tokens_offload == 10 * BS and on_w2.usage.cached_tokens == 10 * BS
    assert not on_w2.kv_from_prefill
    assert on_w2.usage.completion_tokens == first.usage.completion_tokens
    text = w2.metrics.render()
    assert 'kvmesh_worker_cached_tokens_total{' in text and 'source="offload"' in text


async def test_prefill_worker_to_store_to_decode_worker(store, workers) -> None:
    p = await start_worker(_cfg("p1", "prefill", store))
    d = await start_worker(_cfg("d1", "decode", ""))   # restores only through the handle
    workers += [p, d]
    prompt = list(range(300, 300 + 8 * BS + 5))
    async with grpc.aio.insecure_channel(p.address) as ch:
        pre = await worker_pb2_grpc.WorkerStub(ch).Prefill(worker_pb2.PrefillRequest(
            request_id="p", prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=30)
    h = pre.handle
    assert h.store_address == store and len(h.block_keys) == 8 and h.num_tokens == 8 * BS
    assert list(h.block_keys) == _keys(prompt)[:8]
    out = await _generate(d, "d", prompt, kv_handle=h)
    assert out.kv_from_prefill
    assert out.usage.cached_tokens_offload == 8 * BS and out.usage.cached_tokens_gpu == 0


async def test_store_down_recomputes_and_counts_the_fallback(workers) -> None:
    w = await start_worker(_cfg("x1", "decode", f"127.0.0.1:{free_port()}"))
    workers.append(w)
    out = await _generate(w, "r", list(range(700, 700 + 6 * BS + 1)))
    assert out.finish_reason == common_pb2.FINISH_REASON_LENGTH and out.usage.completion_tokens == 2
    assert out.usage.cached_tokens == 0
    text = w.metrics.render()
    line = next((ln for ln in text.splitlines() if ln.startswith("kvmesh_worker_offload_fallbacks_total")), None)
    assert line is not None and float(line.rsplit(" ", 1)[1]) >= 1, text
