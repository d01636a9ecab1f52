"""InferencePool discovery: the router lists and watches the pool's pods with the kubernetes client.

The API server is a small fake served over real HTTP (the client's own transport, a
kubeconfig pointing at it): it serves one InferencePool and the pods API, list and watch
(newline-delimited events pushed by the test). The endpoints behind the pods are a recording
OpenAI server, so a request through the router reaches the discovered pod.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvmesh_router.config import RouterConfig
from kvmesh_router.http_api import build_app
from kvmesh_router.inference_pool import pool_spec
from kvmesh_router.main import build_service
from tests.helpers.openai_engine import OpenAIEngine

pytestmark = pytest.mark.timeout(60)
MODEL = "tiny-llama"


def _pod(name: str, ip: str, ready: bool, rv: int) -> dict:
    return {"kind": "Pod", "apiVersion": "v1",
            "metadata": {"name": name, "namespace": "llm", "resourceVersion": str(rv), "labels": {"app": "vllm"}},
            "status": {"phase": "Running", "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


class FakeApiServer:
    """GET the pool (v1) and list/watch pods; records the label selectors asked for."""

    def __init__(self, pool: dict, pods: list[dict]) -> None:
        self.pool = pool
        self.pods = pods
        self.events: asyncio.Queue = asyncio.Queue()
        self.selectors: list[str] = []
        self.closing = False
        app = FastAPI()
        app.add_api_route("/apis/{group}/{version}/namespaces/{ns}/inferencepools/{name}", self._pool)
        app.add_api_route("/api/v1/namespaces/{ns}/pods", self._pods)
        app.add_api_route("/apis/{group}/{version}/namespaces/{ns}/inferenceobjectives", self._objectives)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    lifespan="off"))
        self.server.install_signal_handlers = lambda: None

    async def start(self) -> int:
        self.task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            await asyncio.sleep(0.01)
        return self.server.servers[0].sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self.closing = True
        self.server.should_exit = True
        await self.task

    async def _pool(self, group: str, version: str, ns: str, name: str) -> JSONResponse:
        if (group, version, ns, name) != ("inference.networking.k8s.io", "v1", "llm", "pool"):
            return JSONResponse({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
                                 "code": 404}, status_code=404)
        return JSONResponse(self.pool)

    async def _objectives(self, group: str, version: str, ns: str) -> JSONResponse:
        if (group, version, ns) != ("inference.networking.x-k8s.io", "v1alpha2", "llm"):
            return JSONResponse({"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404},
                                status_code=404)
        items = [{"metadata": {"name": n}, "spec": {**({"priority": p} if p is not None else {}),
                                                    "poolRef": {"name": pool}}}
                 for n, p, pool in (("batch", -1, "pool"), ("chat", 10, "pool"), ("plain", None, "pool"),
                                    ("elsewhere", -5, "other-pool"))]
        return JSONResponse({"apiVersion": f"{group}/{version}", "kind": "InferenceObjectiveList", "items": items})

    async def _pods(self, ns: str, request: Request):
        q = request.query_params
        self.selectors.append(q.get("labelSelector", ""))
        if q.get("watch") not in ("true", "True", "1"):
            return JSONResponse({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "10"},
                                 "items": self.pods})

        async def stream():
            while not self.closing:
                try:
                    ev = await asyncio.wait_for(self.events.get(), 0.2)
                except TimeoutError:
                    continue
                yield json.dumps(ev) + "\n"

        return StreamingResponse(stream(), media_type="application/json")


def _kubeconfig(path: Path, port: int) -> str:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "t",
        "clusters": [{"name": "t", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "t", "user": {"token": "x"}}],
        "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}]}))
    return str(path)


async def _until(cond, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.05)


async def test_pods_of_the_pool_become_endpoints(tmp_path, tiny_model_dir) -> None:
    engine = await OpenAIEngine(MODEL).start()
    pool = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "pool", "namespace": "llm"},
            "spec": {"selector": {"matchLabels": {"app": "vllm", "tier": "gpu"}},
                     "targetPorts": [{"number": engine.port}], "endpointPickerRef": {"name": "epp"}}}
    api = FakeApiServer(pool, [_pod("p1", "127.0.0.1", True, 5), _pod("p2", "127.0.0.2", False, 6)])
    port = await api.start()
    cfg = RouterConfig(model=MODEL, block_size=32, tokenizer_path=str(tiny_model_dir), http_port=0,
                       auth="off", inference_objectives={"chat": 3}, inference_pool="llm/pool", kubeconfig=_kubeconfig(tmp_path / "kubeconfig", port))
    cfg.validate()
    svc = build_service(cfg)
    svc.cluster.start()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(svc)), base_url="http://r", timeout=30)
    first, second = f"127.0.0.1:{engine.port}", f"127.0.0.2:{engine.port}"
    try:
        await _until(lambda: first in svc.core.endpoints)
        assert second not in svc.core.endpoints   # not ready
        assert api.selectors[0] == "app=vllm,tier=gpu"
        # The pool's InferenceObjectives give the gateway path its priorities (static config wins).
        await _until(lambda: svc.cluster.discovered_objectives != {})
        assert svc.cluster.discovered_objectives == {"batch": -1, "chat": 10, "plain": 0}
        assert [svc.cluster.objective_priority(n) for n in ("batch", "chat", "elsewhere", "")] == [-1, 3, 0, 0]
        r = await client.post("/v1/chat/completions", headers={"x-tenant": "t1"},
                              json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.headers["x-kvmesh-endpoint"] == first, r.text
        assert engine.bodies[-1]["cache_salt"] == svc.salts.salt("t1")
        # The watch: p2 turns ready and joins; p1 is deleted and leaves.
        await api.events.put({"type": "MODIFIED", "object": _pod("p2", "127.0.0.2", True, 11)})
        await _until(lambda: second in svc.core.endpoints)
        await api.events.put({"type": "DELETED", "object": _pod("p1", "127.0.0.1", True, 12)})
        await _until(lambda: first not in svc.core.endpoints)
        assert svc.cluster.external.urls == {second: f"http://{second}"}
    finally:
        await client.aclose()
        await svc.cluster.stop()
        await api.stop()
        await engine.stop()


def test_pool_specs_of_both_api_versions() -> None:
    v1 = {"spec": {"selector": {"matchLabels": {"b": "2", "a": "1"}}, "targetPorts": [{"number": 8000},
                                                                                   {"number": 8001}]}}
    assert pool_spec(v1).label_selector == "a=1,b=2" and pool_spec(v1).ports == (8000, 8001)
    alpha = {"spec": {"selector": {"app": "vllm"}, "targetPortNumber": 8000}}
    assert pool_spec(alpha).label_selector == "app=vllm" and pool_spec(alpha).ports == (8000,)
    for bad in ({}, {"spec": {"selector": {}, "targetPortNumber": 1}},
                {"spec": {"selector": {"app": "x"}}},
                {"spec": {"selector": {"app": "x"}, "targetPorts": [{"number": 70000}]}},
                {"spec": {"selector": {"matchExpressions": [{"key": "a"}]}, "targetPortNumber": 1}}):
        with pytest.raises(ValueError):
            pool_spec(bad)
