"""Tensor-parallel ranks do not share keys: the scheduler offers only what every rank's namespace holds.

vLLM's real config (``tensor_parallel_size=2``), its real ``Request`` and block
hasher, and a real offload store: rank 0's namespace holds more blocks of a
prompt than rank 1's, and the connector's scheduler side offers the shorter run.
"""

from __future__ import annotations

import json

import pytest

from kvmesh.kvstore.client import SyncOffloadClient
from kvmesh_tools.testing.ports import free_port
from kvmesh_tools.testing.procs import ServiceProcess
from tests.services.indexer.test_indexer_vllm import TINY_LLAMA

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]

BS = 32


def test_scheduler_offers_the_blocks_all_tp_ranks_hold(tmp_path) -> None:
    pytest.importorskip("vllm")
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from kvmesh.worker.connector.vllm_connector import KvmeshConnector, event_key

    def ports() -> tuple[list[str], str]:
        port = free_port()
        return ["--host", "127.0.0.1", "--port", str(port), "--ram-capacity-bytes", str(32 << 20)], f"127.0.0.1:{port}"
    store = ServiceProcess.on_fresh_ports("offload", ports, log_path=tmp_path / "offload.log").start(timeout_s=60)
    client = SyncOffloadClient(store.grpc_address, timeout_s=5)
    try:
        model = tmp_path / "model"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(TINY_LLAMA))
        cfg = EngineArgs(model=str(model), load_format="dummy", skip_tokenizer_init=True, block_size=BS,
                         tensor_parallel_size=2, enforce_eager=True, max_model_len=2048,
                         kv_transfer_config=KVTransferConfig(
                             kv_connector="KvmeshConnector", kv_role="kv_both",
                             kv_connector_module_path="kvmesh.worker.connector.vllm_connector",
                             kv_connector_extra_config={"store_address": store.grpc_address})
                         ).create_engine_config()
        conn = KvmeshConnector(cfg, KVConnectorRole.SCHEDULER, None)
        rank0, rank1 = conn._rank_namespaces
        assert rank0 != rank1 and rank0.startswith(conn._namespace + "/tp0of2")

        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        toks = [(i * 7919) % 31000 + 500 for i in range(5 * BS + 3)]

        def request(rid: str) -> Request:
            return Request(rid, toks, SamplingParams(max_tokens=1), None,
                           block_hasher=get_request_block_hasher(BS, hash_fn))
        keys = [event_key(h) for h in request("probe").block_hashes]
        assert len(keys) == 5

        def put(ns: str, n: int) -> None:
            client.put(ns, [(k, bytes([i]) * 64) for i, k in enumerate(keys[:n])], block_size=BS)
        put(rank0, 4)
        put(rank1, 2)
        assert conn.get_num_new_matched_tokens(request("a"), 0)[0] == 2 * BS
        put(rank1, 4)
        assert conn.get_num_new_matched_tokens(request("b"), 0)[0] == 4 * BS
        # Blocks the engine computed itself are not offered again.
        assert conn.get_num_new_matched_tokens(request("c"), 3 * BS)[0] == 1 * BS
    finally:
        client.close()
        store.stop()
