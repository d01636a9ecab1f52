"""A hung offload store never hangs a request: every store call of a worker has a deadline.

The store is a real ``kvmesh serve offload`` process stopped with SIGSTOP: its sockets stay
open and nothing errors, so only a deadline ends a call. A sim worker restoring from it (a
lookup first, or a prefill worker's handle straight to a get) gives up at the configured
deadline, recomputes the prompt and counts the timeout in
``kvmesh_worker_offload_timeouts_total``.
"""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from kvmesh.worker.config import WorkerConfig
from kvmesh.worker.run import Worker, start_worker
from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.services.offload.test_sim_e2e import BS, _generate, _wait_saved

pytestmark = pytest.mark.timeout(120)
LOOKUP_S = 0.5
TRANSFER_S = 1.0
# Slack for a loaded machine; a call without a deadline would wait for the client's 60 s default.
MARGIN_S = 10.0


def _cfg(eid: str, role: str, offload: str) -> WorkerConfig:
    return WorkerConfig(engine="sim", role=role, model="sim-model", endpoint_id=eid, block_size=BS,
                        num_blocks=64, host="127.0.0.1", time_scale=50.0, max_model_len=4096, vocab_size=1000,
                        offload_address=offload, offload_timeout_s=TRANSFER_S, offload_lookup_timeout_s=LOOKUP_S,
                        kv_num_layers=2, kv_num_kv_heads=2, kv_head_dim=32, kv_dtype="bf16")


def _timeouts(w: Worker, op: str) -> float:
    for line in w.metrics.render().splitlines():
        if line.startswith("kvmesh_worker_offload_timeouts_total{") and f'op="{op}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("kvmesh_worker_offload_timeouts_total not exported")


def test_deadlines_are_settings_with_checked_values() -> None:
    for name in ("offload_timeout_s", "offload_lookup_timeout_s"):
        with pytest.raises(Exception, match=name):
            WorkerConfig(**{name: 0}).validate()


async def test_a_hung_store_costs_a_restore_its_deadline_then_the_prompt_is_recomputed(
        offload_process, workers) -> None:
    store = offload_process("--ram-capacity-bytes", str(64 << 20))
    assert store.proc is not None
    w1 = await start_worker(_cfg("w1", "decode", store.grpc_address))
    w2 = await start_worker(_cfg("w2", "decode", store.grpc_address))
    p = await start_worker(_cfg("p1", "prefill", store.grpc_address))
    workers += [w1, w2, p]
    a = list(range(100, 100 + 10 * BS + 3))
    await _generate(w1, "a1", a)
    await _wait_saved(store.grpc_address, a, 10)
    b = list(range(400, 400 + 8 * BS + 5))
    async with grpc.aio.insecure_channel(p.address) as ch:
        pre = await worker_pb2_grpc.WorkerStub(ch).Prefill(worker_pb2.PrefillRequest(
            request_id="pb", prompt_token_ids=b, sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=30)
    assert len(pre.handle.block_keys) == 8

    os.killpg(store.proc.pid, signal.SIGSTOP)
    try:
        # A restore that asks the store what it holds: the lookup's deadline ends it.
        t0 = time.monotonic()
        out = await _generate(w2, "a2", a)
        took = time.monotonic() - t0
        assert out.finish_reason == common_pb2.FINISH_REASON_LENGTH and out.usage.completion_tokens == 2
        assert out.usage.cached_tokens_offload == 0            # recomputed, not restored
        assert LOOKUP_S <= took < LOOKUP_S + MARGIN_S, took
        assert _timeouts(w2, "restore") >= 1
        # A restore from a prefill worker's handle goes straight to a get: the transfer deadline.
        t0 = time.monotonic()
        out = await _generate(w2, "b2", b, kv_handle=pre.handle)
        took = time.monotonic() - t0
        assert out.usage.completion_tokens == 2 and out.usage.cached_tokens_offload == 0
        assert not out.kv_from_prefill
        assert TRANSFER_S <= took < TRANSFER_S + MARGIN_S, took
        assert _timeouts(w2, "restore") >= 2
    finally:
        os.killpg(store.proc.pid, signal.SIGCONT)
    # The store is back: a worker new to the prompt restores it from there again.
    w3 = await start_worker(_cfg("w3", "decode", store.grpc_address))
    workers.append(w3)
    out = await _generate(w3, "a3", a)
    assert out.usage.cached_tokens_offload == 10 * BS
