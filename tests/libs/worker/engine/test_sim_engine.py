"""The async sim engine: vLLM-identical events on the wire, replay, virtual time, offload hook.

Event equality is checked against vLLM's own Python code (its request block
hasher and KVCacheManager, run in-process with the same block size, hash algo
and cache_salt): the sim's published ZMQ events must carry the same hashes,
parents, token ids and extra keys.
"""

from __future__ import annotations

import asyncio

import pytest
import zmq

from kvmesh.events import BlockRemoved, BlockStored, decode_message, is_replay_end
from kvmesh.worker.engine.base import EngineRequest, KvHandle
from kvmesh.worker.engine.sim.engine import SimEngine, SimEngineConfig

pytestmark = pytest.mark.timeout(90)

BS = 16


async def _run(engine: SimEngine, req: EngineRequest):
    outs = [o async for o in engine.generate(req)]
    return outs[-1], [t for o in outs for t in o.new_token_ids]


def _replay_all(endpoint: str, start: int = 0) -> list:
    """Every buffered batch from ``start`` via the replay ROUTER socket (DEALER client)."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        msgs = []
        while True:
            assert dealer.poll(5000), "replay did not answer"
            frames = dealer.recv_multipart()[1:]
            if is_replay_end(frames):
                return msgs
            msgs.append(decode_message(frames))
    finally:
        dealer.close(linger=0)


def _vllm_events(prompts: list[tuple[str, list[int], str | None]], num_blocks: int) -> list:
    """Run vLLM's KVCacheManager on the prompts (each admitted then freed); return its events."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float16)
    m = KVCacheManager(KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                     kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)]),
                       max_model_len=1 << 16, scheduler_block_size=BS, hash_block_size=BS,
                       enable_caching=True, enable_kv_cache_events=True)
    hasher = get_request_block_hasher(BS, sha256_cbor)
    events = []
    for rid, toks, salt in prompts:
        r = Request(rid, toks, SamplingParams(max_tokens=1), None, block_hasher=hasher, cache_salt=salt)
        blocks, n, _ = m.get_computed_blocks(r)
        assert m.allocate_slots(r, r.num_tokens - n, n, blocks) is not None
        events += m.block_pool.take_events()
        m.free(r)
    return events


@pytest.mark.timeout(300)   # imports vLLM: ~20 s on a quiet machine, over 90 s on a loaded one
async def test_published_events_equal_vllm_events() -> None:
    pytest.importorskip("vllm.v1.core.kv_cache_manager")
    prompts = [
        ("a", list(range(1000, 1000 + 4 * BS + 5)), None),
        ("b", list(range(1000, 1000 + 2 * BS)) + list(range(7, 7 + 3 * BS)), None),   # shares 2 blocks
        ("c", list(range(1000, 1000 + 3 * BS + 1)), "tenant-x"),                     # salted
        ("d", list(range(5000, 5000 + 6 * BS + 1)), None),                           # forces evictions
    ]
    nb = 10
    want = _vllm_events(prompts, nb)
    eng = SimEngine(SimEngineConfig(block_size=BS, num_blocks=nb, virtual_time=True, model="m", endpoint_id="e1",
                                    kv_events_endpoint="tcp://*:0", kv_events_replay_endpoint="tcp://*:0",
                                    clear_events_on_start=False))
    await eng.start()
    try:
        for rid, toks, salt in prompts:
            # max_tokens=1: the request ends right after prefill, as on the vLLM side.
            await _run(eng, EngineRequest(rid, toks, max_tokens=1, cache_salt=salt or ""))
        # Read the wire messages back through the replay socket (no ZMQ slow-joiner loss).
        msgs = await asyncio.to_thread(_replay_all, eng.kv_events_replay_endpoint.replace("0.0.0.0", "127.0.0.1"))
    finally:
        await eng.stop()
    got = [e for m in msgs for e in m.batch.events]
    assert [m.seq for m in msgs] == list(range(len(msgs)))
    assert len(got) == len(want)
    saw_removed = False
    for g, w in zip(got, want, strict=True):
        assert type(g).__name__ == type(w).__name__
        if isinstance(g, BlockStored):
            assert g.block_hashes == list(w.block_hashes)
            assert g.parent_block_hash == w.parent_block_hash
            assert g.token_ids == list(w.token_ids)
            assert g.block_size == w.block_size and g.medium == w.medium
            assert g.lora_name == w.lora_name and g.lora_id == w.lora_id
            assert [tuple(x) if x else x for x in g.extra_keys] == [tuple(x) if x else x for x in w.extra_keys]
        else:
            assert isinstance(g, BlockRemoved)
            saw_removed = True
            assert g.block_hashes == list(w.block_hashes) and g.medium == w.medium
    assert saw_removed


async def test_replay_socket_returns_buffered_batches() -> None:
    eng = SimEngine(SimEngineConfig(block_size=BS, num_blocks=32, virtual_time=True, endpoint_id="e2",
                                    kv_events_endpoint="tcp://*:0", kv_events_replay_endpoint="tcp://*:0"))
    await eng.start()
    try:
        for i in range(3):
            await _run(eng, EngineRequest(f"r{i}", list(range(i * 100, i * 100 + 2 * BS + 1)), max_tokens=1))
        msgs = await asyncio.to_thread(_replay_all, eng.kv_events_replay_endpoint.replace("0.0.0.0", "127.0.0.1"), 1)
        seqs = [m.seq for m in msgs]
        # seq 0 is the AllBlocksCleared sent at start; then one batch per request's step.
        assert seqs == list(range(1, eng.events_published))
    finally:
        await eng.stop()


async def test_virtual_time_runs_without_sleeping_and_follows_latency_model() -> None:
    eng = SimEngine(SimEngineConfig(block_size=BS, num_blocks=4096, virtual_time=True,
                                    max_num_batched_tokens=1 << 20))
    await eng.start()
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        out, toks = await _run(eng, EngineRequest("big", list(range(20_000)), max_tokens=3))
        wall = loop.time() - t0
        expected_ttft = eng.latency.estimate_ttft(20_000, 0)
        assert out.num_output_tokens == 3 and len(toks) == 3
        assert eng.now() > expected_ttft > 1.0       # seconds of simulated time ...
        assert wall < expected_ttft                   # ... in less (sleeping it would take all of it)
    finally:
        await eng.stop()


async def test_time_scale_makes_real_time_faster() -> None:
    eng = SimEngine(SimEngineConfig(block_size=BS, num_blocks=1024, time_scale=100.0))
    await eng.start()
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        out, _ = await _run(eng, EngineRequest("x", list(range(4000)), max_tokens=2))
        wall = loop.time() - t0
        model = eng.latency.estimate_ttft(4000, 0) + eng.latency.p.itl_s
        assert wall < model / 2   # 1/100 of it plus overhead; unscaled it would take all of it
        assert out.finished
    finally:
        await eng.stop()


async def test_stop_tokens_and_ignore_eos() -> None:
    eng = SimEngine(SimEngineConfig(block_size=BS, num_blocks=256, virtual_time=True, vocab_size=50))
    await eng.start()
    try:
        _, toks = await _run(eng, EngineRequest("s", [1, 2, 3], max_tokens=200, seed=3))
        stop = toks[5]
        out, toks2 = await _run(eng, EngineRequest("s2", [1, 2, 3], max_tokens=200, seed=3, stop_token_ids=[stop]))
        assert out.finish_reason == "stop" and toks2[-1] == stop and len(toks2) <= 6
    finally:
        await eng.stop()


async def test_answers_end_after_about_answer_tokens(tiny_model_dir) -> None:
    """With ``answer_tokens`` an answer stops (EOS, "stop") at a length drawn per request between half and
    1.5 times it, so a request that names no max_tokens (vLLM then allows the rest of max_model_len) ends;
    the same seed ends at the same token, a smaller max_tokens still ends it ("length"), and ignore_eos
    runs to max_tokens."""
    eng = SimEngine(SimEngineConfig(block_size=BS, num_blocks=512, virtual_time=True, answer_tokens=40,
                                    tokenizer=str(tiny_model_dir)))
    await eng.start()
    try:
        eos = eng._answer_eos
        lengths = []
        for i in range(30):
            out, toks = await _run(eng, EngineRequest(f"r{i}", [1, 2, 3], max_tokens=100_000))
            assert out.finish_reason == "stop" and toks[-1] == eos
            lengths.append(len(toks))
        assert all(20 < n <= 60 for n in lengths) and len(set(lengths)) > 5
        a = await _run(eng, EngineRequest("x", [1, 2, 3], max_tokens=100_000, seed=7))
        b = await _run(eng, EngineRequest("y", [1, 2, 3], max_tokens=100_000, seed=7))
        assert a[1] == b[1]
        out, toks = await _run(eng, EngineRequest("short", [1, 2, 3], max_tokens=8))
        assert out.finish_reason == "length" and len(toks) == 8
        out, toks = await _run(eng, EngineRequest("all", [1, 2, 3], max_tokens=90, ignore_eos=True))
        assert out.finish_reason == "length" and len(toks) == 90
    finally:
        await eng.stop()
    with pytest.raises(ValueError, match="EOS"):
        SimEngineConfig(answer_tokens=40).validate()   # no eos_token_id, no tokenizer


async def test_a_share_of_auto_answers_call_tools() -> None:
    """``tool_call_share``: with tool_choice auto about that share of answers are calls, drawn per request
    (the same seed, the same draw); "required" and a named tool always call; 1.0 (the default) always."""
    tools = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]

    def req(rid: str, choice: object = "auto", seed: int | None = None) -> EngineRequest:
        return EngineRequest(rid, [1, 2, 3], max_tokens=4, tools=tools, tool_choice=choice, seed=seed)

    eng = SimEngine(SimEngineConfig(block_size=BS, num_blocks=256, virtual_time=True, tool_call_share=0.5))
    await eng.start()
    try:
        outs = [(await _run(eng, req(f"r{i}")))[0].finish_reason for i in range(200)]
        assert 70 <= outs.count("tool_calls") <= 130 and outs.count("length") == 200 - outs.count("tool_calls")
        first = [(await _run(eng, req(f"s{i}", seed=11)))[0].finish_reason for i in range(5)]
        assert len(set(first)) == 1
        for choice in ("required", {"type": "function", "function": {"name": "read"}}):
            assert all([(await _run(eng, req(f"q{i}", choice)))[0].finish_reason == "tool_calls" for i in range(20)])
    finally:
        await eng.stop()
    eng = SimEngine(SimEngineConfig(block_size=BS, num_blocks=256, virtual_time=True))
    await eng.start()
    try:
        assert all([(await _run(eng, req(f"a{i}")))[0].finish_reason == "tool_calls" for i in range(20)])
    finally:
        await eng.stop()
    with pytest.raises(ValueError, match="tool_call_share"):
        SimEngineConfig(tool_call_share=1.5).validate()


# ---------------------------------------------------------------------------- offload hook


@pytest.fixture(scope="module")
def offload_store(tmp_path_factory):
    from kvmesh_tools.testing.procs import ServiceProcess

    log = tmp_path_factory.mktemp("offload") / "offload.log"
    proc = ServiceProcess.with_ports("offload", lambda port: ["--port", str(port), "--host", "127.0.0.1",
                                                              "--ram-capacity-bytes", str(64 << 20)], log_path=log)
    proc.start(timeout_s=30)
    yield proc.grpc_address
    proc.stop()


def _offload_engine(address: str, eid: str) -> SimEngine:
    return SimEngine(SimEngineConfig(block_size=BS, num_blocks=256, virtual_time=True, endpoint_id=eid,
                                     model="sim-model", offload_address=address))


async def test_finished_blocks_are_saved_and_restored_by_another_engine(offload_store) -> None:
    prompt = list(range(3000, 3000 + 10 * BS + 3))
    a = _offload_engine(offload_store, "a")
    b = _offload_engine(offload_store, "b")
    await a.start()
    await b.start()
    try:
        out, _ = await _run(a, EngineRequest("r1", prompt, max_tokens=2))
        assert out.num_cached_tokens == 0
        for _ in range(100):
            if a.offload_saved_blocks >= 10:
                break
            await asyncio.sleep(0.05)
        assert a.offload_saved_blocks >= 10
        out, _ = await _run(b, EngineRequest("r2", prompt + [1, 2], max_tokens=2))
        assert out.num_cached_tokens_gpu == 0
        assert out.num_cached_tokens_offload == 10 * BS and out.num_cached_tokens == 10 * BS
        assert not out.kv_from_prefill
        # Restore time = measured transfer + modelled host-to-device copy of the real bytes.
        assert b.restore_seconds >= b.latency.restore_time(10 * BS * b.cfg.kv_bytes_per_token)
    finally:
        await a.stop()
        await b.stop()


async def _wait_saved(engine: SimEngine, blocks: int) -> None:
    for _ in range(600):
        if engine.offload_saved_blocks >= blocks:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{engine.offload_saved_blocks} of {blocks} blocks saved after 30 s")


async def test_prefix_evicted_while_queued_is_restored_when_scheduled(offload_store) -> None:
    """On arrival the prefix is on the GPU (and in the store); a running request evicts it while
    this one waits. Asked at scheduling time, the store restores it: reused, not recomputed."""
    prompt = list(range(24_000, 24_000 + 10 * BS + 3))
    # 31 usable blocks and one running sequence at a time; the filler grows into all 31.
    eng = SimEngine(SimEngineConfig(block_size=BS, num_blocks=32, max_num_seqs=1, virtual_time=True,
                                    endpoint_id="late", model="sim-model", offload_address=offload_store))
    await eng.start()
    try:
        await _run(eng, EngineRequest("warm", prompt, max_tokens=2))
        await _wait_saved(eng, 10)
        filler = eng.generate(EngineRequest("filler", list(range(27_000, 27_000 + 4 * BS)), max_tokens=27 * BS))
        await filler.__anext__()                   # running: the next request queues behind it
        queued = eng.generate(EngineRequest("queued", prompt + [7, 8], max_tokens=2))
        first = asyncio.ensure_future(queued.__anext__())
        rest = [o async for o in filler]
        assert rest[-1].finished
        outs = [await first] + [o async for o in queued]
        out = outs[-1]
        assert out.truth.gpu_tokens == 10 * BS     # on the GPU when it arrived
        assert out.num_cached_tokens_gpu < 10 * BS   # evicted while it queued
        assert out.num_cached_tokens == 10 * BS    # the store gave the rest back
        assert out.num_cached_tokens_offload == 10 * BS - out.num_cached_tokens_gpu
        assert eng.offload_late_restores == 1 and eng.offload_fallbacks == 0
    finally:
        await eng.stop()


async def test_prefill_handle_restored_by_decode_engine(offload_store) -> None:
    prompt = list(range(9000, 9000 + 8 * BS + 5))
    p = _offload_engine(offload_store, "p")
    d = _offload_engine(offload_store, "d")
    d.cfg.offload_address = ""            # decode restores only through the handle it is given
    await p.start()
    await d.start()
    try:
        res = await p.prefill(EngineRequest("pf", prompt, max_tokens=16))
        assert res.output.num_output_tokens == 1 and len(res.output.new_token_ids) == 1
        h = res.handle
        assert isinstance(h, KvHandle) and len(h.block_keys) == 8 and h.num_tokens == 8 * BS
        assert h.store_address == offload_store and h.first_token_id == res.output.new_token_ids[0]
        out, toks = await _run(d, EngineRequest("dc", prompt, max_tokens=4, kv_handle=h))
        assert out.kv_from_prefill and out.num_cached_tokens_offload == 8 * BS
        assert len(toks) == 4
        # A handle for a different prompt is not used (its chain does not match).
        other = list(range(1, 1 + 8 * BS + 5))
        out, _ = await _run(d, EngineRequest("dc2", other, max_tokens=1, kv_handle=h))
        assert not out.kv_from_prefill and out.num_cached_tokens_offload == 0
    finally:
        await p.stop()
        await d.stop()


async def test_store_down_degrades_to_local_prefill() -> None:
    from kvmesh_tools.testing.ports import free_port

    eng = _offload_engine(f"127.0.0.1:{free_port()}", "x")
    await eng.start()
    try:
        out, toks = await asyncio.wait_for(_run(eng, EngineRequest("r", list(range(100)), max_tokens=2)), 30)
        assert out.finished and out.num_cached_tokens == 0 and len(toks) == 2
    finally:
        await eng.stop()


async def test_prefill_only_generate_hands_kv_to_store(offload_store) -> None:
    """The prefill role's Generate (one token) also leaves the prompt's blocks in the store."""
    prompt = list(range(20_000, 20_000 + 6 * BS + 1))
    p = _offload_engine(offload_store, "p2")
    await p.start()
    try:
        out, toks = await _run(p, EngineRequest("g", prompt, max_tokens=1, prefill_only=True))
        assert len(toks) == 1 and out.finish_reason == "length"
        for _ in range(100):
            if p.offload_saved_blocks >= 6:
                break
            await asyncio.sleep(0.05)
        assert p.offload_saved_blocks >= 6
    finally:
        await p.stop()


def test_digest_memo_is_exact() -> None:
    """The sim's block-digest memo returns exactly what hashing returns (salt, divergence, reuse)."""
    import random

    from kvmesh.hashing import BlockHasher, ExtraKeys
    from kvmesh.worker.engine.sim.engine import _DigestMemo

    h = BlockHasher("sha256_cbor", BS)
    memo = _DigestMemo(h, capacity=64)
    rng = random.Random(3)
    base = [rng.randrange(32000) for _ in range(20 * BS + 5)]
    salted = ExtraKeys(cache_salt="s1")
    cases = [
        (base, None), (base, None),                                    # cold, then all hits
        (base[: 10 * BS] + [1] * (6 * BS), None),                       # shared prefix, then diverges
        (base, salted), (base[: 12 * BS], salted),                      # salt changes every block
        (base[: 12 * BS], ExtraKeys(lora_name="ad1")),
        ([rng.randrange(32000) for _ in range(80 * BS)], None),         # overflows the memo (LRU)
        (base, None),
    ]
    for toks, extra in cases:
        assert memo.digests(toks, extra) == h.block_digests(toks, extra)
    assert memo.hits > 0 and len(memo._memo) <= 64


@pytest.mark.parametrize("lora_paths", [{"ad1": "/adapters/ad1"}, {}])
async def test_lora_blocks_hash_the_configured_path_as_vllm_does(lora_paths) -> None:
    """The sim hashes ``("lora", name, path)`` with its configured path ('' when none), as vLLM's hasher does."""
    pytest.importorskip("vllm.v1.core.kv_cache_utils")
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from kvmesh.hashing import BlockHasher, ExtraKeys

    toks = list(range(300, 300 + 3 * BS + 2))
    path = lora_paths.get("ad1", "")
    if path:
        init_none_hash(sha256_cbor)
        r = Request("v", toks, SamplingParams(max_tokens=1), None, lora_request=LoRARequest("ad1", 1, path),
                    block_hasher=get_request_block_hasher(BS, sha256_cbor))
        want = [int.from_bytes(h, "big") & ((1 << 64) - 1) for h in r.block_hashes]
    else:
        # vLLM refuses an empty adapter path; the sim's default is kvmesh's hasher with "".
        want = BlockHasher("sha256_cbor", BS).block_keys(toks, ExtraKeys(lora_name="ad1", lora_path=""))
    eng = SimEngine(SimEngineConfig(block_size=BS, num_blocks=32, virtual_time=True, endpoint_id="e-lora",
                                    lora_names=["ad1"], lora_paths=lora_paths,
                                    kv_events_endpoint="tcp://*:0", kv_events_replay_endpoint="tcp://*:0",
                                    clear_events_on_start=False))
    await eng.start()
    try:
        assert eng.info().lora_paths == {"ad1": path}
        await _run(eng, EngineRequest("s", toks, max_tokens=1, lora_name="ad1"))
        msgs = await asyncio.to_thread(_replay_all, eng.kv_events_replay_endpoint.replace("0.0.0.0", "127.0.0.1"))
    finally:
        await eng.stop()
    got = [h for m in msgs for e in m.batch.events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert got == want and len(want) == 3


async def test_the_replay_buffer_keeps_the_worker_configured_byte_bound() -> None:
    """The replay buffer's byte bound comes from the worker's config (a soak's memory reaches it early)."""
    from kvmesh.worker.config import WorkerConfig

    bound = 4096
    cfg = WorkerConfig(kv_events_buffer_bytes=bound, block_size=BS, num_blocks=64, virtual_time=True,
                       kv_events_endpoint="tcp://*:0", kv_events_replay_endpoint="tcp://*:0")
    eng = SimEngine(cfg.sim_engine_config("e3"))
    await eng.start()
    try:
        for i in range(20):
            await _run(eng, EngineRequest(f"r{i}", list(range(i * 1000, i * 1000 + 8 * BS + 1)), max_tokens=1))
        pub = eng._publisher
        assert pub is not None and eng.events_published > 20
        # Every batch here is far smaller than the bound: it holds what fits, not all 20+.
        assert 0 < pub.buffer_bytes <= bound and len(pub._buffer) < eng.events_published
    finally:
        await eng.stop()
