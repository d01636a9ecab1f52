"""The worker gRPC service (sim engine) over real gRPC on loopback.

Covers the contract: streaming Generate with usage and cached tokens, Prefill,
GetLoad/GetInfo, Abort, client cancel freeing blocks, INVALID_ARGUMENT for bad
input, UNAVAILABLE + NOT_SERVING on an engine crash, KV events on ZMQ, vLLM
metric names, one span per request, and the real `kvmesh serve decode` process.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import zmq
import zmq.asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.events import BlockStored, decode_message
from kvmesh.hashing import BlockHasher
from kvmesh.worker.config import WorkerConfig
from kvmesh.worker.run import Worker, start_worker
from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.worker.v1 import worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.timeout(60)

BS = 16


def _cfg(**kw) -> WorkerConfig:
    base = dict(engine="sim", role="decode", model="sim-model", endpoint_id="w-test", block_size=BS,
                num_blocks=64, host="127.0.0.1", time_scale=50.0, max_model_len=4096, vocab_size=1000,
                kv_events_endpoint="tcp://*:0", lora_names=["ad1"])
    base.update(kw)
    return WorkerConfig(**base)


@pytest.fixture
async def worker() -> AsyncIterator[Worker]:
    w = await start_worker(_cfg())
    yield w
    await w.stop(0)


@pytest.fixture
async def stub(worker: Worker) -> AsyncIterator[worker_pb2_grpc.WorkerStub]:
    async with grpc.aio.insecure_channel(worker.address) as ch:
        yield worker_pb2_grpc.WorkerStub(ch)


def _gen(rid: str, toks: list[int], max_tokens: int = 4, **kw) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(request_id=rid, prompt_token_ids=toks,
                                      sampling=common_pb2.SamplingParams(max_tokens=max_tokens), **kw)


async def _collect(stub, req) -> list[worker_pb2.GenerateResponse]:
    return [m async for m in stub.Generate(req)]


async def test_generate_streams_tokens_and_reports_cached_tokens(stub) -> None:
    prompt = list(range(100, 100 + 5 * BS + 3))
    msgs = await _collect(stub, _gen("a", prompt, 5))
    assert sum(len(m.token_ids) for m in msgs) == 5
    assert msgs[0].ttft_s > 0
    last = msgs[-1]
    assert last.finished and last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert last.usage.prompt_tokens == len(prompt) and last.usage.completion_tokens == 5
    assert last.usage.cached_tokens == 0
    # Same prefix again: every full prompt block is a hit (the last token is always recomputed).
    msgs = await _collect(stub, _gen("b", prompt + [7, 8], 2))
    assert msgs[-1].usage.cached_tokens == 5 * BS
    assert msgs[-1].usage.cached_tokens_gpu == 5 * BS
    assert msgs[-1].usage.cached_tokens_offload == 0


async def test_deterministic_tokens_with_seed(stub) -> None:
    def req(rid):
        return worker_pb2.GenerateRequest(request_id=rid, prompt_token_ids=[1, 2, 3],
                                          sampling=common_pb2.SamplingParams(max_tokens=6, seed=42))
    a = [t for m in await _collect(stub, req("s1")) for t in m.token_ids]
    b = [t for m in await _collect(stub, req("s2")) for t in m.token_ids]
    assert a == b and len(a) == 6 and all(0 <= t < 1000 for t in a)


@pytest.mark.parametrize("req,needle", [
    (_gen("x", []), "prompt is empty"),
    (_gen("x", [1, 2, 5000]), "outside the vocabulary"),
    (_gen("x", [1] * 4096), "max_model_len"),
    (_gen("x", [1, 2], lora_name="nope"), "unknown LoRA"),
    (_gen("", [1, 2]), "request_id is required"),
    (_gen("x", [1, 2], model="other"), "unknown model"),
    (worker_pb2.GenerateRequest(request_id="x", prompt_token_ids=[1],
                                sampling=common_pb2.SamplingParams(max_tokens=2, temperature=-1)), "temperature"),
    (worker_pb2.GenerateRequest(request_id="x", prompt_token_ids=[1], sampling=common_pb2.SamplingParams(
        max_tokens=2, structured_outputs_json='{"regex": "a", "json_object": true}')), "exactly one constraint"),
    (worker_pb2.GenerateRequest(request_id="x", prompt_token_ids=[1], sampling=common_pb2.SamplingParams(
        max_tokens=2, structured_outputs_json="[")), "not JSON"),
    # The sim writes a structured answer in its tokenizer's tokens; this worker has none.
    (worker_pb2.GenerateRequest(request_id="x", prompt_token_ids=[1], sampling=common_pb2.SamplingParams(
        max_tokens=2, structured_outputs_json='{"json_object": true}')), "--tokenizer"),
])
async def test_bad_input_is_invalid_argument(stub, req, needle) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await _collect(stub, req)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in ei.value.details()


async def test_prefill_role_caps_at_one_token_and_prefill_rpc(worker, stub) -> None:
    resp = await stub.Prefill(worker_pb2.PrefillRequest(request_id="p1", prompt_token_ids=list(range(40))))
    assert resp.usage.prompt_tokens == 40 and resp.usage.completion_tokens == 1
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await stub.Prefill(worker_pb2.PrefillRequest(request_id="p2", prompt_token_ids=[]))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_cancel_frees_blocks(worker, stub) -> None:
    engine = worker.engine
    free0 = engine.load().free_blocks
    call = stub.Generate(_gen("long", list(range(3 * BS)), max_tokens=500))
    got = 0
    async for m in call:
        got += len(m.token_ids)
        if got >= 2:
            break
    assert engine.load().running == 1
    assert engine.load().free_blocks < free0
    call.cancel()
    for _ in range(100):
        if engine.load().running == 0 and engine.load().free_blocks == free0:
            break
        await asyncio.sleep(0.02)
    ld = engine.load()
    assert ld.running == 0 and ld.waiting == 0
    assert ld.free_blocks == free0


async def test_abort_rpc_ends_stream(worker, stub) -> None:
    call = stub.Generate(_gen("ab", list(range(20)), max_tokens=1000))
    it = call.__aiter__()
    await it.__anext__()
    assert (await stub.Abort(worker_pb2.AbortRequest(request_id="ab"))).found
    rest = [m async for m in it]
    assert rest[-1].finished and rest[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert not (await stub.Abort(worker_pb2.AbortRequest(request_id="ab"))).found


async def test_load_and_info(worker, stub) -> None:
    info = await stub.GetInfo(worker_pb2.GetInfoRequest())
    assert info.endpoint_id == "w-test" and info.engine == "sim" and info.block_size == BS
    assert info.hash_algo == common_pb2.HASH_ALGO_SHA256_CBOR and info.role == common_pb2.ROLE_DECODE
    assert info.kv_events_endpoint.startswith("tcp://127.0.0.1:")
    assert list(info.lora_names) == ["ad1"] and info.kv_bytes_per_token == 2 * 2 * 2 * 32 * 2
    ld = await stub.GetLoad(worker_pb2.GetLoadRequest())
    assert ld.num_blocks == 64 and ld.free_blocks == 63 and ld.block_size == BS and ld.timestamp > 0


async def test_engine_crash_is_unavailable_and_not_serving(worker, stub) -> None:
    call = stub.Generate(_gen("c", list(range(20)), max_tokens=3000))
    it = call.__aiter__()
    await it.__anext__()
    worker.engine.inject_fault("boom")
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        async for _ in it:
            pass
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    async with grpc.aio.insecure_channel(worker.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for _ in range(50):
            st = (await health.Check(health_pb2.HealthCheckRequest(service=""))).status
            if st == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            await asyncio.sleep(0.05)
        assert st == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await _collect(stub, _gen("d", [1, 2, 3]))
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_kv_events_reach_a_zmq_subscriber_with_vllm_hashes(worker, stub) -> None:
    from kvmesh.hashing import ExtraKeys

    info = await stub.GetInfo(worker_pb2.GetInfoRequest())
    ctx = zmq.asyncio.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(info.kv_events_endpoint)
    hasher = BlockHasher("sha256_cbor", BS)
    try:
        stored: list[BlockStored] = []
        # The subscription needs a moment to reach the publisher (ZMQ slow joiner): keep sending.
        for i in range(20):
            prompt = list(range(500 + i * 64, 500 + i * 64 + 3 * BS + 1))
            await _collect(stub, _gen(f"ev{i}", prompt, 1, cache_salt="tenant-a"))
            try:
                msg = decode_message(await asyncio.wait_for(sub.recv_multipart(), 0.5))
            except TimeoutError:
                continue
            assert msg.topic == "kv@w-test@sim-model"
            stored = [e for e in msg.batch.events if isinstance(e, BlockStored)]
            if stored:
                break
        assert stored
        want = hasher.block_keys(prompt, ExtraKeys(cache_salt="tenant-a"))
        assert stored[0].block_hashes == want
        assert stored[0].parent_block_hash is None and stored[0].medium == "GPU"
        assert stored[0].token_ids == prompt[: 3 * BS]
        assert stored[0].extra_keys[0] == ("tenant-a",) and stored[0].extra_keys[1] is None
    finally:
        sub.close(linger=0)


async def test_metrics_use_vllm_names(worker, stub) -> None:
    await _collect(stub, _gen("m1", list(range(40)), 2))
    await _collect(stub, _gen("m2", list(range(40)), 2))
    text = worker.metrics.render()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:cache_config_info",
                 "vllm:time_to_first_token_seconds", "kvmesh_worker_requests_total"):
        assert name in text, name
    hits = [ln for ln in text.splitlines() if ln.startswith("vllm:prefix_cache_hits_total")]
    assert float(hits[0].split()[-1]) == 2 * BS
    assert 'num_gpu_blocks="64"' in text


async def test_one_span_per_request_with_gen_ai_attributes(worker, stub) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvmesh.telemetry import setup_tracing

    exporter = InMemorySpanExporter()
    setup_tracing("test-worker", exporter)
    await _collect(stub, _gen("t1", list(range(40)), 3))
    spans = [s for s in exporter.get_finished_spans() if s.name == "kvmesh.worker.Generate"]
    assert len(spans) == 1
    a = spans[0].attributes
    assert a["gen_ai.usage.input_tokens"] == 40 and a["gen_ai.usage.output_tokens"] == 3
    assert "gen_ai.usage.cache_read.input_tokens" in a and a["gen_ai.latency.time_to_first_token"] > 0
    assert a["gen_ai.request.id"] == "t1"


def test_decode_service_process_serves(tmp_path) -> None:
    """The real `kvmesh serve decode` process: readiness, Generate, graceful stop."""
    from kvmesh_tools.testing.procs import ServiceProcess

    proc = ServiceProcess.with_ports("decode", lambda port: [
        "--port", str(port), "--host", "127.0.0.1", "--block-size", "16", "--num-blocks", "128",
        "--time-scale", "100", "--endpoint-id", "d1"], log_path=tmp_path / "decode.log")
    proc.start(timeout_s=30)
    try:
        with grpc.insecure_channel(proc.grpc_address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            msgs = list(stub.Generate(_gen("r", list(range(50)), 3), timeout=10))
            assert msgs[-1].finished and msgs[-1].usage.completion_tokens == 3
            assert stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5).endpoint_id == "d1"
    finally:
        assert proc.stop() == 0


async def test_worker_registers_with_indexer_and_its_events_are_indexed(tmp_path) -> None:
    """Real indexer process: the worker self-registers (with its publisher address),
    the indexer subscribes, and a Lookup sees the worker's blocks."""
    from kvmesh_api.indexer.v1 import indexer_pb2, indexer_pb2_grpc
    from kvmesh_tools.testing.procs import ServiceProcess

    idx = ServiceProcess.with_ports("indexer", lambda p: ["--port", str(p), "--host", "127.0.0.1",
                                                          "--default-block-size", str(BS)],
                                    log_path=tmp_path / "indexer.log")
    await asyncio.to_thread(idx.start, 30)
    iport = idx.port
    w = None
    try:
        w = await start_worker(_cfg(endpoint_id="w-reg", indexer_address=f"127.0.0.1:{iport}", heartbeat_s=0.2))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{iport}") as ch:
            ix = indexer_pb2_grpc.IndexerStub(ch)
            eps = (await ix.ListEndpoints(indexer_pb2.ListEndpointsRequest())).endpoints
            mine = [e for e in eps if e.endpoint.endpoint_id == "w-reg"]
            assert mine and mine[0].endpoint.kv_events_endpoint.startswith("tcp://127.0.0.1:")
            assert mine[0].endpoint.grpc_address == f"127.0.0.1:{w.port}"
            # No wait for the indexer's subscriber: events published before it has joined are
            # lost to it (ZMQ's slow joiner), and its tail probe replays them from the worker's
            # buffer within tail_probe_s (5 s), so the poll below allows for that.
            prompt = list(range(700, 700 + 4 * BS + 1))
            async with grpc.aio.insecure_channel(w.address) as wch:
                await _collect(worker_pb2_grpc.WorkerStub(wch), _gen("ix", prompt, 1))
            keys = BlockHasher("sha256_cbor", BS).block_keys(prompt)
            blocks = 0
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                resp = await ix.Lookup(indexer_pb2.LookupRequest(model="sim-model",
                                                                 chain=indexer_pb2.BlockChain(keys=keys)))
                blocks = max((m.combined_blocks for m in resp.matches if m.endpoint_id == "w-reg"), default=0)
                if blocks == 4:
                    break
                await asyncio.sleep(0.1)
            assert blocks == 4
            # Stopping leaves: the index expires the endpoint at once and forgets its blocks.
            await w.stop(0)
            w = None
            eps = (await ix.ListEndpoints(indexer_pb2.ListEndpointsRequest())).endpoints
            assert [(e.alive, e.blocks) for e in eps if e.endpoint.endpoint_id == "w-reg"] == [(False, 0)]
    finally:
        if w is not None:
            await w.stop(0)
        idx.stop()


async def test_full_waiting_queue_is_resource_exhausted() -> None:
    w = await start_worker(_cfg(endpoint_id="w-q", max_num_seqs=1, max_waiting=1, kv_events_endpoint=""))
    try:
        async with grpc.aio.insecure_channel(w.address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            first = stub.Generate(_gen("q1", [1, 2, 3], max_tokens=3000))
            await first.__aiter__().__anext__()           # running
            second = stub.Generate(_gen("q2", [1, 2, 3], max_tokens=5))
            for _ in range(50):                            # wait until it is queued
                if w.engine.load().waiting == 1:
                    break
                await asyncio.sleep(0.02)
            ld = await stub.GetLoad(worker_pb2.GetLoadRequest())
            assert ld.running == 1 and ld.waiting == 1 and ld.waiting_prefill_tokens == 3
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await _collect(stub, _gen("q3", [1, 2, 3]))
            assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "waiting queue is full" in ei.value.details()
            first.cancel()
            msgs = [m async for m in second]
            assert msgs[-1].finished and msgs[-1].usage.completion_tokens == 5
    finally:
        await w.stop(0)


async def test_port_0_names_the_endpoint_and_address_after_the_bound_port() -> None:
    """With port 0 the worker binds first and names itself after the port it got: the default
    endpoint id, ``address`` and the servicer answer all carry that port."""
    seen: list[int] = []
    w = await start_worker(_cfg(endpoint_id="", port=0, kv_events_endpoint=""), on_listening=seen.append)
    try:
        assert seen == [w.port] and w.port > 0
        assert w.endpoint_id.endswith(f"-{w.port}") and w.address == f"127.0.0.1:{w.port}"
        async with grpc.aio.insecure_channel(w.address) as ch:
            info = await worker_pb2_grpc.WorkerStub(ch).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
        assert info.endpoint_id == w.endpoint_id
    finally:
        await w.stop(0)


async def test_readiness_waits_for_the_engine(monkeypatch) -> None:
    """NOT_SERVING while the engine starts, SERVING once it is up."""
    import kvmesh.worker.run as run_mod
    from kvmesh.worker.engine.sim.engine import SimEngine

    gate = asyncio.Event()

    class SlowStart(SimEngine):
        async def start(self) -> None:
            await gate.wait()
            await super().start()

    real_build = run_mod.build_engine
    monkeypatch.setattr(run_mod, "build_engine", lambda cfg, eid: SlowStart(real_build(cfg, eid).cfg))
    listening: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    # Port 0: the worker binds and tells us the port it got (no port picked before the bind).
    task = asyncio.create_task(start_worker(_cfg(endpoint_id="w-slow", port=0, kv_events_endpoint=""),
                                            on_listening=listening.set_result))
    port = await asyncio.wait_for(listening, 30)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        health = health_pb2_grpc.HealthStub(ch)
        # Serving liveness once on_listening ran: no retry needed.
        status = (await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=30)).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        gate.set()
        w = await asyncio.wait_for(task, 10)
        try:
            status = (await health.Check(health_pb2.HealthCheckRequest(service=""))).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await w.stop(0)


async def test_max_tokens_above_max_model_len_is_invalid(stub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await _collect(stub, _gen("big", [1, 2], max_tokens=5000))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_model_len" in ei.value.details()


async def test_http_api_started_by_run_worker() -> None:
    """With http_port set, the worker also answers OpenAI HTTP (token-id prompts) and advertises it."""
    import httpx

    w = await start_worker(_cfg(endpoint_id="w-http", http_port=0, kv_events_endpoint=""))
    try:
        async with grpc.aio.insecure_channel(w.address) as ch:
            info = await worker_pb2_grpc.WorkerStub(ch).GetInfo(worker_pb2.GetInfoRequest())
        assert info.http_address.startswith("127.0.0.1:")
        async with httpx.AsyncClient(base_url=f"http://{info.http_address}", timeout=10) as http:
            r = await http.post("/v1/completions", json={"model": "sim-model", "prompt": [1, 2, 3, 4],
                                                         "max_tokens": 3})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 3 and r.headers["x-kvmesh-endpoint"] == "w-http"
    finally:
        await w.stop(0)


async def test_connecting_publisher_reaches_a_binding_subscriber() -> None:
    """A concrete host in kv_events_endpoint makes the publisher connect (vLLM's rule); the subscriber binds."""
    sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@w-conn@")
    sub.bind("tcp://127.0.0.1:0")                      # the kernel's port, held from here on
    ep = sub.getsockopt_string(zmq.LAST_ENDPOINT)
    w = await start_worker(_cfg(endpoint_id="w-conn", kv_events_endpoint=ep))
    try:
        async with grpc.aio.insecure_channel(w.address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            assert (await stub.GetInfo(worker_pb2.GetInfoRequest())).kv_events_endpoint == ep
            seen = False
            # A connecting PUB needs a moment before the subscription reaches it; keep sending.
            for i in range(20):
                await _collect(stub, _gen(f"cn{i}", list(range(i * 100, i * 100 + 2 * BS + 1)), 1))
                try:
                    msg = decode_message(await asyncio.wait_for(sub.recv_multipart(), 0.5))
                except TimeoutError:
                    continue
                if any(isinstance(e, BlockStored) for e in msg.batch.events):
                    seen = True
                    break
        assert seen
    finally:
        sub.close(linger=0)
        await w.stop(0)


async def test_info_reports_lora_paths_and_path_only_adapters_are_served() -> None:
    w = await start_worker(_cfg(lora_paths={"ad2": "/adapters/ad2"}))
    try:
        async with grpc.aio.insecure_channel(w.address) as ch:
            info = await worker_pb2_grpc.WorkerStub(ch).GetInfo(worker_pb2.GetInfoRequest())
        assert list(info.lora_names) == ["ad1", "ad2"]
        assert dict(info.lora_paths) == {"ad1": "", "ad2": "/adapters/ad2"}
    finally:
        await w.stop(0)
