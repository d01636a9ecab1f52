"""The kvmesh KV connector on real vLLM engines: restore evicted KV from the offload store, and P->D split.

Two vLLM workers with small KV caches share one offload store. Both load the
tiny model with the same seeded random weights (vLLM's dummy weights make the
output nearly independent of the context, which would hide a bad restore), so
greedy outputs can be compared token for token between a restore and a
recomputation; a control shows the output and the stored bytes depend on the context.
"""

from __future__ import annotations

import time

import grpc
import pytest

from kvmesh.hashing import BlockHasher
from kvmesh.kvstore.client import SyncOffloadClient
from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.worker.v1 import worker_pb2, worker_pb2_grpc
from kvmesh_tools.testing.procs import ServiceProcess
from tests.fixtures.vllm import VLLM_ENV, VllmWorker

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(480)]

BS = 32
KV_CACHE_BYTES = 2 << 20      # 128 blocks of 32 tokens (16 KiB each): 4096 tokens


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("offload") / "offload.log"
    proc = ServiceProcess.with_ports("offload", lambda port: ["--host", "127.0.0.1", "--port", str(port),
                                                              "--ram-capacity-bytes", str(256 << 20)],
                                     env=VLLM_ENV, log_path=log)
    proc.start(timeout_s=60)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def workers(vllm_workers, store) -> tuple[VllmWorker, VllmWorker]:
    w1, w2 = vllm_workers([
        {"name": "conn-w1", "kv_cache_bytes": KV_CACHE_BYTES, "offload_address": store.grpc_address,
         "weights": True},
        {"name": "conn-w2", "kv_cache_bytes": KV_CACHE_BYTES, "offload_address": store.grpc_address,
         "weights": True},
    ])
    return w1, w2


@pytest.fixture(scope="module")
def stubs(workers):
    chans = [grpc.insecure_channel(w.address) for w in workers]
    yield [worker_pb2_grpc.WorkerStub(c) for c in chans]
    for c in chans:
        c.close()


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 31_000 + 500 for i in range(n)]


def _generate(stub, rid: str, prompt: list[int], max_tokens: int = 8, **kw):
    req = worker_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                     sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                        ignore_eos=True), **kw)
    toks: list[int] = []
    last = None
    for msg in stub.Generate(req, timeout=180):
        toks.extend(msg.token_ids)
        last = msg
    assert last is not None and last.finished
    return toks, last


def _wait_in_store(store: ServiceProcess, namespace: str, keys: list[int], timeout_s: float = 20.0) -> int:
    with SyncOffloadClient(store.grpc_address) as c:
        deadline = time.monotonic() + timeout_s
        while True:
            n = c.contains(namespace, keys)
            if n == len(keys) or time.monotonic() > deadline:
                return n
            time.sleep(0.1)


def test_evicted_prefix_is_restored_from_store_on_another_worker(stubs, store) -> None:
    s1, s2 = stubs
    info = s1.GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
    a = _prompt(11, 10 * BS + 5)
    cold, first = _generate(s1, "A-1", a)
    assert first.usage.cached_tokens == 0

    # The worker saved A's 10 full blocks under vLLM's own block hashes (= kvmesh's keys).
    keys = BlockHasher("sha256_cbor", BS).block_keys(a)
    assert len(keys) == 10
    ns = _namespace(s1, store, keys)
    assert _wait_in_store(store, ns, keys) == 10

    # Enough other traffic to push A out of worker 1's 4096-token cache.
    for i in range(6):
        _generate(s1, f"filler-{i}", _prompt(100 + i, 1000), max_tokens=1)
    again, on_w1 = _generate(s1, "A-2", a)
    assert on_w1.usage.cached_tokens == 10 * BS
    assert on_w1.usage.cached_tokens_offload > 0, "A should have been evicted locally and restored"
    assert again == cold

    # Worker 2 never saw A: everything beyond its (empty) own hit comes from the store.
    restored, on_w2 = _generate(s2, "A-3", a)
    assert on_w2.usage.cached_tokens == 10 * BS
    assert on_w2.usage.cached_tokens_offload == 10 * BS and on_w2.usage.cached_tokens_gpu == 0
    assert not on_w2.kv_from_prefill
    assert restored == cold, "restored KV must give exactly the recomputed greedy output"
    assert info.engine == "vllm"
    _control_output_depends_on_the_restored_context(s2, store, ns, a, cold)


def _control_output_depends_on_the_restored_context(stub, store, ns: str, a: list[int], cold: list[int]) -> None:
    """The equality ``restored == cold`` above means something only if the output depends on the KV.

    A one-token change of a 325-token prompt moves the tiny model's attention by about 1/325,
    which bf16 can round away on one CPU's kernels and not on another's, so that is no control.
    Two properties that hold on any CPU instead:
    - the KV bytes differ: the first block of another context is stored with other bytes
      (layer 0's K/V at a position are a projection of that position's token embedding alone);
    - the output differs: a prompt whose ten restorable blocks are all replaced (same length, same
      last partial block) changes every attended key and value, an O(1) change, not a rounding.
      Each replacement context is one token repeated: dummy weights are tiny, so attention is
      near-uniform and its output is the mean of the values; over random tokens that mean shrinks
      by ~sqrt(n), over one repeated token it does not, so the context's pull on the logits is
      ~18x larger than a random context's and an argmax tie cannot hide it. Three such contexts
      are tried; one differing output is enough evidence.
    """
    tail = a[10 * BS:]
    others = [[tok] * (10 * BS) + tail for tok in (1234, 5678, 9012)]   # contexts no other test uses
    outputs = [_generate(stub, f"A-ctl-{j}", o)[0] for j, o in enumerate(others)]
    assert any(out != cold for out in outputs), f"output independent of the context: {cold}"
    key_a = BlockHasher("sha256_cbor", BS).block_keys(a)[0]
    key_o = BlockHasher("sha256_cbor", BS).block_keys(others[0])[0]
    assert _wait_in_store(store, ns, [key_o]) == 1
    with SyncOffloadClient(store.grpc_address) as c:
        bytes_a, bytes_o = c.get(ns, [key_a]) + c.get(ns, [key_o])
    assert len(bytes_a) == len(bytes_o) > 0 and bytes_a != bytes_o


def _namespace(stub, store, keys) -> str:
    # The namespace is the engine's; a Prefill handle names it. Use a tiny prefill to learn it.
    resp = stub.Prefill(worker_pb2.PrefillRequest(request_id="ns-probe", prompt_token_ids=_prompt(999, BS + 1)),
                        timeout=120)
    assert resp.handle.namespace.startswith("tiny-llama/L2-H2-D32-bf16-bs32/")
    return resp.handle.namespace


def test_prefill_on_p_decode_on_d_with_kv_from_store(stubs) -> None:
    p, d = stubs
    b = _prompt(21, 12 * BS + 9)
    resp = p.Prefill(worker_pb2.PrefillRequest(request_id="B-p", prompt_token_ids=b,
                                               sampling=common_pb2.SamplingParams(temperature=0.0)), timeout=120)
    h = resp.handle
    assert h.num_tokens == 12 * BS and len(h.block_keys) == 12
    assert list(h.block_keys) == BlockHasher("sha256_cbor", BS).block_keys(b)
    assert h.producer_endpoint == "conn-w1" and h.has_first_token
    assert resp.usage.prompt_tokens == len(b) and resp.usage.completion_tokens <= 1

    toks, last = _generate(d, "B-d", b, kv_handle=h)
    assert last.kv_from_prefill
    assert last.usage.cached_tokens_offload == 12 * BS
    assert toks[0] == h.first_token_id
    # Reference: a full recomputation (a fresh cache_salt defeats every cache).
    ref, ref_last = _generate(p, "B-ref", b, cache_salt="recompute")
    assert ref_last.usage.cached_tokens == 0
    assert toks == ref


def test_prefill_hands_off_full_prompt_even_if_store_lost_it(stubs, store) -> None:
    # P still caches B's prompt locally, but the store has lost it: the hand-off must re-save it.
    p = stubs[0]
    b = _prompt(21, 12 * BS + 9)
    keys = BlockHasher("sha256_cbor", BS).block_keys(b)
    first = p.Prefill(worker_pb2.PrefillRequest(request_id="B-p2", prompt_token_ids=b), timeout=120)
    assert len(first.handle.block_keys) == 12
    with SyncOffloadClient(store.grpc_address) as c:
        assert c.delete(first.handle.namespace, keys) == 12
        assert c.contains(first.handle.namespace, keys) == 0
    t0 = time.monotonic()
    again = p.Prefill(worker_pb2.PrefillRequest(request_id="B-p3", prompt_token_ids=b), timeout=120)
    assert again.usage.cached_tokens_gpu == 12 * BS          # a local hit on P ...
    assert list(again.handle.block_keys) == keys              # ... and still a complete hand-off
    assert time.monotonic() - t0 < 10


def test_unknown_namespace_or_missing_blocks_recompute(stubs) -> None:
    # A prompt no one computed: the store has nothing, the engine computes it all.
    toks, last = _generate(stubs[1], "C-1", _prompt(31, 5 * BS + 1))
    assert last.usage.cached_tokens == 0 and len(toks) == 8


def test_store_keys_match_restore_count_for_partial_chain(stubs, store) -> None:
    # Worker 1 computes a 7-block prompt; worker 2 asks for a prompt that shares only 4 of its blocks.
    s1, s2 = stubs
    base = _prompt(41, 7 * BS + 2)
    _generate(s1, "D-1", base, max_tokens=1)
    keys = BlockHasher("sha256_cbor", BS).block_keys(base)
    ns = _namespace(s1, store, keys)
    assert _wait_in_store(store, ns, keys) == 7
    partial = base[: 4 * BS] + _prompt(42, 3 * BS)
    _, last = _generate(s2, "D-2", partial)
    assert last.usage.cached_tokens_offload == 4 * BS


def _fallbacks(w: VllmWorker) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{w.metrics_port}/metrics", timeout=5).read().decode()
    vals = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("kvmesh_worker_offload_fallbacks")]
    assert vals, "kvmesh_worker_offload_fallbacks not exported"
    return sum(vals)


def test_store_down_workers_recompute_and_prefill_reports_unavailable(stubs, store, workers) -> None:
    # Runs last in this module: it stops the shared store.
    s1, s2 = stubs
    e = _prompt(51, 6 * BS + 3)
    ref, _ = _generate(s1, "E-ref", e)
    store.stop(grace_s=2)
    toks, last = _generate(s2, "E-1", e)
    assert toks == ref
    assert last.usage.cached_tokens_offload == 0
    assert _fallbacks(workers[1]) >= 1, "the recompute fallback is counted in a metric"
    with pytest.raises(grpc.RpcError) as err:
        s1.Prefill(worker_pb2.PrefillRequest(request_id="E-p", prompt_token_ids=_prompt(52, 4 * BS + 1)), timeout=60)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "offload" in err.value.details().lower()
    # The engines are still healthy afterwards.
    again, _ = _generate(s1, "E-2", e)
    assert again == ref
