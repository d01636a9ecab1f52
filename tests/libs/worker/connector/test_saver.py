"""The connector's background block saver against a real offload store process (no vLLM needed)."""

from __future__ import annotations

import pytest

from kvmesh.kvstore.client import SyncOffloadClient
from kvmesh.worker.connector.layout import connector_namespace
from kvmesh.worker.connector.saver import BlockSaver, SaveJob
from kvmesh_tools.testing.ports import free_port

pytestmark = pytest.mark.timeout(90)

NS = connector_namespace("tiny-llama", 2, 2, 32, "bfloat16", 32)


def _job(keys: list[int], size: int = 4096, parent: int | None = None) -> SaveJob:
    return SaveJob(NS, keys, [bytes([k % 251]) * size for k in keys], [[k] * 32 for k in keys], parent, 32)


def test_namespace_names_model_shape_and_byte_layout() -> None:
    assert NS == "tiny-llama/L2-H2-D32-bf16-bs32/vllm-paged-cpu"
    assert connector_namespace("m", 2, 2, 32, "bf16", 32, device="cuda") != NS.replace("tiny-llama", "m")


def test_saver_writes_blocks_and_skips_present_ones(offload_process) -> None:
    store = offload_process()
    with SyncOffloadClient(store.grpc_address) as client:
        saver = BlockSaver(client)
        try:
            assert saver.submit(_job([11, 12, 13]))
            assert saver.flush(20)
            assert client.contains(NS, [11, 12, 13]) == 3
            assert client.get(NS, [12]) == [bytes([12]) * 4096]
            # A chain sharing the first two blocks only writes the new tail.
            assert saver.submit(_job([11, 12, 14]))
            assert saver.flush(20)
            assert client.contains(NS, [11, 12, 14]) == 3
            assert saver.stats.blocks_stored == 4
            assert saver.stats.blocks_already_present == 2
            assert saver.stats.failed_jobs == 0
        finally:
            saver.close()


def test_byte_budget_drops_instead_of_growing(offload_process) -> None:
    store = offload_process()
    with SyncOffloadClient(store.grpc_address) as client:
        saver = BlockSaver(client, max_pending_bytes=1000)
        try:
            assert not saver.submit(_job([1, 2], size=600))
            assert saver.stats.dropped_jobs == 1
            assert saver.flush(5)
            assert client.contains(NS, [1]) == 0
        finally:
            saver.close()


def test_store_down_counts_failures_and_keeps_running() -> None:
    dead = f"127.0.0.1:{free_port()}"
    with SyncOffloadClient(dead, use_shm=False, timeout_s=1.0) as client:
        saver = BlockSaver(client)
        try:
            assert saver.submit(_job([5]))
            assert saver.submit(_job([6]))
            assert saver.flush(20)
            assert saver.stats.failed_jobs == 2 and saver.stats.blocks_stored == 0
        finally:
            saver.close()
