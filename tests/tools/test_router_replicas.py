"""Two router replicas behind the shipped Envoy (``kvmesh up --routers 2``), as real processes.

The stack is ``LocalStack`` with ``routers=2``: indexer, offload store, two sim decode workers,
two routers and Envoy's front door over the routers' HTTP ports (``deploy/envoy/envoy.yaml``).
- A sibling burst split across the replicas lands on one worker: the pick replica one made
  is in the indexer (its speculative entry, then the engine's events), and replica two reads it.
- A replica killed with SIGKILL during a steady stream loses no request, not even those it
  held: Envoy retries a refused or dropped try on the other replica, and its health check
  takes the dead one out.
- A Responses conversation chained by ``previous_response_id`` goes on whichever replica
  answers each turn: the replicas keep stored responses in one Redis.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvmesh.api_keys import TenantSalts
from kvmesh.rpc.tls import sync_channel
from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.indexer.v1 import indexer_pb2, indexer_pb2_grpc
from kvmesh_tools.stack.envoy import ROUTERS
from kvmesh_tools.stack.launcher import OFFLOAD_ID, LocalStack, StackConfig
from tests.fixtures.router import metric

pytestmark = [pytest.mark.envoy, pytest.mark.timeout(300)]
MODEL = "sim-model"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    logs = tmp_path_factory.mktemp("replicas")
    st = LocalStack(StackConfig(routers=2, decode_workers=2, prefill_workers=0, redis="off", model=MODEL,
                                time_scale=20.0, log_dir=str(logs)))
    # This machine may be far busier than a router host: the routers' indexer lookups get time to
    # answer, and speculative picks outlive a slow first request, so that what is tested is the
    # sharing, not this machine's load (the defaults are 0.25 s and 2 s).
    slow = {"KVMESH_ROUTER_LOOKUP_TIMEOUT_S": "5", "KVMESH_ROUTER_SPECULATIVE_TTL_S": "60"}
    saved = {k: os.environ.get(k) for k in slow}
    os.environ.update(slow)
    try:
        st.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        assert st.envoy is not None
        _wait(lambda: st.envoy.healthy_hosts(ROUTERS) == 2, "envoy never saw both routers healthy")
        yield st
    finally:
        st.stop()


def _wait(cond, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(what)
        time.sleep(0.1)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30000) for _ in range(n)]


def _complete(c: httpx.Client, base: str, prompt: list[int], max_tokens: int = 2) -> httpx.Response:
    return c.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens})


def test_both_replicas_serve_through_envoy(stack: LocalStack) -> None:
    assert len(stack.router_http_addresses) == 2 and stack.http_address == stack.envoy.routers_base
    with httpx.Client(timeout=30, headers=stack.auth_headers()) as c:
        for i in range(4):
            r = _complete(c, stack.http_address, _tokens(100, 500 + i))
            assert r.status_code == 200, r.text
    stats = httpx.get(f"http://127.0.0.1:{stack.envoy.admin_port}/stats?filter=kvmesh-routers", timeout=5).text
    # round robin: every replica answered
    per_host = httpx.get(f"http://127.0.0.1:{stack.envoy.admin_port}/clusters", timeout=5).text
    served = [line for line in per_host.splitlines() if line.startswith(f"{ROUTERS}::") and "::rq_success::" in line]
    assert len(served) == 2 and all(int(line.rsplit("::", 1)[1]) > 0 for line in served), (served, stats)


def test_a_response_chain_continues_on_either_replica(stack: LocalStack) -> None:
    """A Responses conversation chained by ``previous_response_id``, each turn answered by the other
    replica: the replicas share the stored responses (the stack's Redis for them)."""
    assert stack.responses_redis is not None
    one, two = stack.router_http_addresses
    with httpx.Client(timeout=60, headers=stack.auth_headers()) as c:
        prev = None
        for turn, base in enumerate((one, two, one, two)):
            body = {"model": MODEL, "input": f"Turn {turn}: go on.", "max_output_tokens": 2}
            if prev is not None:
                body["previous_response_id"] = prev
            r = c.post(f"{base}/v1/responses", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["previous_response_id"] == prev and r.json()["store"] is True
            prev = r.json()["id"]
        items = c.get(f"{one}/v1/responses/{prev}/input_items", params={"order": "asc", "limit": 100}).json()
        said = [i["content"][0]["text"] for i in items["data"] if i.get("role") == "user"]
        assert said == [f"Turn {t}: go on." for t in range(4)]


def test_sibling_burst_split_across_replicas_colocates(stack: LocalStack) -> None:
    """The burst's first request goes to replica one, the rest to replica two at once: replica
    two has routed none of them, and learns where the prefix lives from the indexer alone."""
    one, two = stack.router_http_addresses
    shared = _tokens(4000, 31)   # its prefill outweighs a few queued siblings on one worker
    with httpx.Client(timeout=60, headers=stack.auth_headers()) as c:
        r = _complete(c, one, shared + _tokens(40, 2000))
        assert r.status_code == 200, r.text
        leader = r.json()["kvmesh"]["endpoint"]
        # Replica one's pick reaches the indexer as a speculative entry; the engine's events follow.
        _wait(lambda: _indexed_blocks(stack, shared, leader) >= len(shared) // 64,
              "replica one's pick never reached the indexer")
        # The leader's worker writes the prefix through to the store after its prefill; until the
        # store's events are indexed, a follower placed elsewhere restores more than either replica
        # can know of (a true "lag" mismatch, not what this test is about). Both replicas must also
        # price the store (--offload-enabled auto: once the registry lists it live).
        _wait(lambda: _indexed_blocks(stack, shared, OFFLOAD_ID) >= len(shared) // 64,
              "the leader's prefix never reached the store's index")
        _wait(lambda: _offload_priced(stack) == [1, 1], "a replica never priced the live store")

        def follower(i: int) -> dict:
            r = _complete(c, two, shared + _tokens(40, 2001 + i))
            assert r.status_code == 200, r.text
            return r.json()["kvmesh"]

        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            got = list(ex.map(follower, range(4)))
    # Replica two never recomputes the prefix: each follower runs where it is cached (the
    # leader's worker, or a sibling's on replica two) or restores it from the store, which the
    # router knows holds it; and each prediction holds. Replica two may see the leader's worker
    # still busy in a load report taken while the leader ran, and restore elsewhere instead.
    why = (leader, _offload_priced(stack), [(k["endpoint"], k["reason"], k["predicted_cached_tokens_gpu"],
                     k["predicted_cached_tokens_offload"], k["mismatch"]) for k in got])
    assert all(k["predicted_cached_tokens"] >= len(shared) // 64 * 64 for k in got), why
    assert all(k["mismatch"] == "" for k in got), why
    assert all(k["endpoint"] == leader or k["predicted_cached_tokens_offload"] or
               any(o["endpoint"] == k["endpoint"] and o["predicted_cached_tokens_offload"] for o in got)
               for k in got), why


def _indexed_blocks(stack: LocalStack, tokens: list[int], endpoint: str) -> int:
    """Blocks of ``tokens`` the indexer places on ``endpoint``: speculative or from engine events."""
    # With API keys on, the router salts every request with the key's tenant salt.
    salt = TenantSalts.from_file(Path(stack.cfg.log_dir) / "auth" / "salt-secret").salt("local") \
        if stack.api_key else ""
    with sync_channel(stack.indexer_address, stack.client_tls()) as ch:
        r = indexer_pb2_grpc.IndexerStub(ch).Lookup(indexer_pb2.LookupRequest(
            model=MODEL, tokens=common_pb2.TokenIds(ids=tokens), include_speculative=True,
            extra_keys=common_pb2.ExtraKeys(cache_salt=salt)), timeout=5)
    return max((max(m.speculative_blocks, m.combined_blocks) for m in r.matches if m.endpoint_id == endpoint),
               default=0)


def _offload_priced(stack: LocalStack) -> list[int]:
    """Each router's ``kvmesh_router_offload_enabled`` gauge (1: its cost prices restores)."""
    return [int(metric(sp.flag_port("--metrics-port"), "kvmesh_router_offload_enabled", stack.metrics_headers()))
            for sp in stack.procs if sp.name == "router"]


def _host_stat(stack: LocalStack, address: str, stat: str) -> int:
    """One per-host figure of Envoy's routers cluster (admin /clusters)."""
    text = httpx.get(f"http://127.0.0.1:{stack.envoy.admin_port}/clusters", timeout=5).text
    prefix = f"{ROUTERS}::{address.removeprefix('http://')}::{stat}::"
    return sum(int(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix))


def test_killing_a_replica_loses_no_request_that_had_not_started(stack: LocalStack) -> None:
    """Four clients send one request after another through Envoy; replica two is SIGKILLed while
    it holds some of them. No response byte of a non-streamed request leaves a router before it
    is done, so every request, those in flight on the victim included, must succeed: Envoy
    retries a dropped or refused try on the other replica, and its health check takes the dead
    one out."""
    victim = [sp for sp in stack.procs if sp.name == "router"][1]
    victim_http = stack.router_http_addresses[1]
    assert victim.proc is not None
    results: list[tuple[float, int, str]] = []     # (issued at, status, body on failure)
    lock = threading.Lock()
    stop = threading.Event()

    def client(seed: int) -> None:
        with httpx.Client(timeout=60, headers=stack.auth_headers()) as c:
            i = 0
            while not stop.is_set():
                issued = time.monotonic()
                try:
                    r = _complete(c, stack.http_address, _tokens(120, seed * 10_000 + i), max_tokens=48)
                    outcome = (issued, r.status_code, "" if r.status_code == 200 else r.text[:300])
                except httpx.HTTPError as exc:
                    outcome = (issued, -1, repr(exc))
                with lock:
                    results.append(outcome)
                i += 1

    retried_before = _cluster_stats(stack).get("cluster.kvmesh-routers.upstream_rq_retry", 0)
    threads = [threading.Thread(target=client, args=(s,), daemon=True) for s in range(1, 5)]
    for t in threads:
        t.start()
    try:
        _wait(lambda: len(results) >= 8, "the steady stream never got going")
        _wait(lambda: _host_stat(stack, victim_http, "rq_active") >= 1, "the victim never held a request")
        os.killpg(victim.proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        _wait(lambda: stack.envoy.healthy_hosts(ROUTERS) == 1, "envoy never took the dead replica out")
        out_at = time.monotonic()
        _wait(lambda: sum(1 for t0, _, _ in results if t0 > out_at) >= 12, "the stream stalled after the kill")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    after = [r for r in results if r[0] > killed_at]
    failed = [r for r in results if r[1] != 200]
    assert after and not failed, f"{len(failed)} of {len(results)} requests failed: {failed[:3]}"
    # The victim's requests in flight at the kill were tried again on the survivor.
    assert _cluster_stats(stack)["cluster.kvmesh-routers.upstream_rq_retry"] > retried_before


def _cluster_stats(stack: LocalStack) -> dict[str, int]:
    text = httpx.get(f"http://127.0.0.1:{stack.envoy.admin_port}/stats?filter=^cluster.kvmesh-routers",
                     timeout=5).text
    return {k: int(v) for k, _, v in (line.partition(": ") for line in text.splitlines()) if v.isdigit()}

