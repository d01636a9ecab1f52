"""A slow indexer: lookups past their deadline are answered from the router's local view.

The indexer process is made slow on purpose (a ``sitecustomize`` delays every ``Lookup`` by
0.6 s, past the router's 0.25 s deadline). Before the local view, every request then fell back
to ``approx``. Now a session's next turn is routed to the engine that holds its prefix, on a
prediction that holds, without a fallback; the late answers are merged into the view.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh_api.router.v1 import router_pb2
from kvmesh_tools.testing.procs import ServiceProcess
from tests.fixtures.router import BLOCK, MODEL, RouterStack, rand_tokens, start_router, start_workers

pytestmark = pytest.mark.timeout(150)

_SLOW = '''
import asyncio
from kvmesh_indexer.servicer import IndexerServicer
_lookup = IndexerServicer._lookup


async def _slow(self, request, context):
    await asyncio.sleep(0.6)
    return await _lookup(self, request, context)


IndexerServicer._lookup = _slow
'''


def _samples(port: int, name: str) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == name:
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[next(iter(s.labels.values()))] = s.value
    return out


def test_late_lookups_use_the_local_view_not_approx(tmp_path: Path, procs) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SLOW)
    idx = procs(ServiceProcess.with_ports(
        "indexer", lambda port: ["--host", "127.0.0.1", "--port", str(port), "--models",
                                 f"{MODEL}@{BLOCK}@sha256_cbor", "--default-model", MODEL],
        env={"PYTHONPATH": f"{site}:{os.environ.get('PYTHONPATH', '')}"},
        log_path=tmp_path / "indexer.log").start(timeout_s=60))
    ws = start_workers(tmp_path, ["w1", "w2", "w3"], indexer=idx.grpc_address)
    for w in ws.values():
        procs(w)
    router, http = start_router(tmp_path, [], indexer=idx.grpc_address, port_flags=["--metrics-port"],
                                extra=["--speculative-ttl-s", "0.2", "--lookup-timeout-s", "0.25",
                                       "--lookup-late-s", "2"])
    mport = router.flag_port("--metrics-port")
    procs(router)
    st = RouterStack(router, http, ws, idx)
    deadline = time.monotonic() + 30
    while len(st.stub.ListModels(router_pb2.ListModelsRequest(), timeout=5).models[0].endpoints) < 3:
        assert time.monotonic() < deadline, "router did not discover the workers"
        time.sleep(0.1)
    try:
        tokens = rand_tokens(900, 11)
        holder = ""
        finals = []
        for turn in range(4):
            out, fin = st.generate(tokens, session_id=f"slow-{turn}")   # no session affinity to lean on
            finals.append(fin)
            holder = holder or fin.routing.endpoint
            tokens = tokens + out + rand_tokens(70, 20 + turn)
            time.sleep(0.3)   # past the router's own speculative entries
        for fin in finals[1:]:
            r = fin.routing
            assert r.endpoint == holder, r
            assert "fallback" not in r.reason, r
            assert r.predicted_cached_tokens == fin.usage.cached_tokens > 0, fin
            assert r.mismatch == ""
        time.sleep(1.0)   # the last late answers come in
        lookups = _samples(mport, "kvmesh_router_lookups")
        assert lookups.get("local", 0) >= 3 and lookups.get("late_merged", 0) >= 3, lookups
        assert lookups.get("ok", 0) == 0
    finally:
        st.close()
