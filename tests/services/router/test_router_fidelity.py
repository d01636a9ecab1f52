"""Prediction fidelity live: the worker reports its cache at arrival, the router classifies misses.

Real processes: an indexer, an offload store registered for every model (as ``kvmesh up``
starts it), sim workers and a router. The router's ``kvmesh_router_mispredictions_total{cause}``
and each response's ``routing.mismatch`` must agree with what happened; a view bug planted in the
router process on purpose (a ``sitecustomize`` that over-reports the prediction) must be caught,
and without it there must be none.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh_api.router.v1 import router_pb2
from kvmesh_tools.testing.procs import ServiceProcess
from tests.fixtures.router import (
    RouterStack,
    rand_tokens,
    start_indexer,
    start_router,
    start_workers,
    wait_endpoints,
)

pytestmark = pytest.mark.timeout(180)

_OVER_REPORT = '''
from kvmesh.routing.policy import Policy
_decision = Policy._decision


def _over(self, req, win, reason, table, fallback=""):   # a view that claims one block it does not have
    d = _decision(self, req, win, reason, table, fallback)
    d.predicted_cached_tokens_gpu += req.block_size
    return d


Policy._decision = _over
'''


def _misses(metrics_port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "kvmesh_router_mispredictions":
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[s.labels["cause"]] = s.value
    return out


def _survival(metrics_port: int) -> dict[str, float]:
    """``kvmesh_router_hit_survival`` by endpoint (kvmesh.routing.survival)."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    return {s.labels["endpoint"]: s.value for fam in text_string_to_metric_families(text)
            if fam.name == "kvmesh_router_hit_survival" for s in fam.samples}


def _moved(metrics_port: int) -> tuple[float, float, float, float]:
    """(requests, prompt tokens, cached tokens, given-up tokens) of the moved turns (kvmesh.routing.moves)."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    got = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    return tuple(got.get(f"kvmesh_router_moved_{k}_total", -1.0)   # type: ignore[return-value]
                 for k in ("requests", "prompt_tokens", "cached_tokens", "given_up_tokens"))


class _Stack:
    def __init__(self, tmp: Path, bug: bool) -> None:
        self.procs: list[ServiceProcess] = []
        self.idx = self._keep(start_indexer(tmp))
        # No --model: the store announces its blocks for every model ("any"), as in `kvmesh up`.
        self.store = self._keep(ServiceProcess.with_ports(
            "offload", lambda sp, ep: ["--host", "127.0.0.1", "--port", str(sp), "--endpoint-id", "store-0",
                                       "--events-endpoint", f"tcp://*:{ep}", "--indexer-address",
                                       self.idx.grpc_address, "--advertise-host", "127.0.0.1"],
            count=2, log_path=tmp / "offload.log").start(60))
        self.workers = start_workers(tmp, ["w1", "w2"], indexer=self.idx.grpc_address,
                                     extra=["--offload-address", self.store.grpc_address])
        for w in self.workers.values():
            self._keep(w)
        env = {}
        if bug:
            site = tmp / "site"
            site.mkdir()
            (site / "sitecustomize.py").write_text(_OVER_REPORT)
            import os
            env["PYTHONPATH"] = f"{site}:{os.environ.get('PYTHONPATH', '')}"
        router, http = start_router(tmp, [], indexer=self.idx.grpc_address, env=env,
                                    extra=["--speculative-ttl-s", "0.3"], port_flags=["--metrics-port"])
        self.metrics_port = router.flag_port("--metrics-port")
        self._keep(router)
        self.st = RouterStack(router, http, self.workers, self.idx)
        wait_endpoints(self.st, 2)

    def _keep(self, p: ServiceProcess) -> ServiceProcess:
        self.procs.append(p)
        return p

    def close(self) -> None:
        self.st.close()
        for p in reversed(self.procs):
            p.stop(grace_s=2)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Stack]:
    s = _Stack(tmp_path_factory.mktemp("fidelity"), bug=False)
    try:
        yield s
    finally:
        s.close()


def test_exact_predictions_carry_no_class_and_the_store_is_predicted(stack: _Stack) -> None:
    st = stack.st
    tokens = rand_tokens(700, 71)
    holder = None
    moved0 = _moved(stack.metrics_port)
    for turn in range(3):
        out, fin = st.generate(tokens, session_id="fid-1")
        holder = holder or fin.routing.endpoint
        assert fin.routing.predicted_cached_tokens == fin.usage.cached_tokens, (turn, fin)
        assert fin.routing.mismatch == ""
        assert not fin.routing.moved and fin.routing.given_up_tokens == 0
        tokens = tokens + out + rand_tokens(60, 700 + turn)
        st.wait_indexed(holder, tokens=tokens[:64])
        time.sleep(0.4)
    # Every predicted hit was found: the split rule trusts the holder's predictions in full.
    assert _survival(stack.metrics_port)[holder] == 1.0
    assert _moved(stack.metrics_port) == moved0   # every turn went back to its session's endpoint
    # The holder dies; the store (registered for every model) still has the prefix, and the
    # router knows it: the restore is predicted, not a surprise.
    st.wait_indexed("store-0", tokens=tokens[:64])
    stack.workers[holder].kill()
    prompt = tokens + rand_tokens(50, 799)
    _, fin = st.generate(prompt, session_id="fid-1")
    r = fin.routing
    assert r.endpoint != holder
    assert r.predicted_cached_tokens_offload > 0
    assert r.predicted_cached_tokens == fin.usage.cached_tokens and r.mismatch == ""
    # The session's turn left its endpoint: one move, its prompt, and what it reused (the restore).
    # It gave up nothing: its dead endpoint was no candidate, and the store restores anywhere.
    assert r.reused_tokens > 0
    assert r.moved and r.given_up_tokens == 0
    assert _moved(stack.metrics_port) == (moved0[0] + 1, moved0[1] + len(prompt), moved0[2] + r.reused_tokens,
                                          moved0[3])


def test_a_burst_is_explained_and_there_is_no_view_bug(stack: _Stack) -> None:
    st = stack.st
    live = [w for w, p in stack.workers.items() if p.alive()] or list(stack.workers)
    assert live
    shared = rand_tokens(1500, 81)

    def one(i: int) -> router_pb2.Final:
        return st.generate(shared + rand_tokens(40, 900 + i), max_tokens=2)[1]

    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        finals = list(ex.map(one, range(6)))
    for f in finals:
        if f.routing.predicted_cached_tokens != f.usage.cached_tokens:
            assert f.routing.mismatch not in ("", "view_bug", "unknown"), f
        else:
            assert f.routing.mismatch == ""
    assert _misses(stack.metrics_port).get("view_bug", 0) == 0


def test_a_planted_view_bug_is_caught(tmp_path: Path) -> None:
    s = _Stack(tmp_path, bug=True)
    try:
        doc = rand_tokens(600, 91)
        out, first = s.st.generate(doc, session_id="bug")
        s.st.wait_indexed(first.routing.endpoint, tokens=doc[:64])
        time.sleep(0.35 + first.routing.score)   # past both speculative TTLs: the index alone counts
        _, fin = s.st.generate(doc + out + rand_tokens(40, 92), session_id="bug")
        assert fin.routing.predicted_cached_tokens == fin.usage.cached_tokens + 32
        assert fin.routing.mismatch == "view_bug"
        assert _misses(s.metrics_port).get("view_bug", 0) >= 1
        # The engine found less than predicted, and the survival ratio the split rule reads says so.
        rate = _survival(s.metrics_port)[fin.routing.endpoint]
        assert 0.0 < rate < 1.0
    finally:
        s.close()
