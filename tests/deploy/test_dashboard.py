"""The Grafana dashboard shows what the issue asks for, using metrics the services really export.

The metric names are not checked against a hand-kept list: the stack's processes
(router with ext_proc, indexer, offload store, prefill and decode workers) are
scraped on their real ``/metrics`` ports after some traffic, and every series the
dashboard queries must be among the families they expose.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvmesh-dashboard.json"
METRIC_RE = re.compile(r"\b((?:kvmesh_|vllm:)[a-zA-Z0-9_:]+)")
SUFFIXES = ("_bucket", "_sum", "_count")

pytestmark = pytest.mark.timeout(300)


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def exprs() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard()["panels"] if p["type"] != "row" for t in p["targets"]]


def test_dashboard_covers_the_required_views() -> None:
    d = dashboard()
    assert d["uid"] and d["title"]
    titles = " | ".join(p["title"].lower() for p in d["panels"])
    for topic in ("hit rate", "predicted", "time to first token", "inter-token", "queue depth",
                  "offload bytes", "restore latency", "staleness"):
        assert topic in titles, f"no panel about {topic!r}"
    for title, expr in exprs():
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), title
        assert METRIC_RE.search(expr), f"{title}: no kvmesh/vllm metric in {expr}"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))


def test_compose_provisions_the_dashboard() -> None:
    prov = yaml.safe_load((ROOT / "deploy/compose/grafana/provisioning/dashboards/kvmesh.yaml").read_text())
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    path = prov["providers"][0]["options"]["path"]
    assert any(m.startswith("./deploy/grafana:") and m.split(":")[1] == path for m in mounts)


def exported_families(port: int) -> set[str]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {m.group(1) for m in re.finditer(r"(?m)^# TYPE (\S+) \S+", text)}


def test_every_dashboard_metric_is_exported_by_a_service(deploy_stack) -> None:
    # Traffic that touches every path: a split request (prefill -> offload -> decode), and
    # a repeat of it (cache hits, offload restore).
    prompt = [20000 + i for i in range(400)]
    for _ in range(2):
        r = httpx.post(f"http://127.0.0.1:{deploy_stack.router_http}/v1/completions",
                       json={"model": "tiny", "prompt": prompt, "max_tokens": 3}, timeout=60)
        assert r.status_code == 200, r.text
    families: set[str] = set()
    for name, port in deploy_stack.metrics.items():
        got = exported_families(port)
        assert got, f"{name} exports nothing on :{port}"
        families |= got
    missing = {}
    for title, expr in exprs():
        for metric in METRIC_RE.findall(expr):
            base = next((metric[: -len(s)] for s in SUFFIXES if metric.endswith(s)), metric)
            if metric not in families and base not in families:
                missing.setdefault(metric, title)
    assert not missing, f"dashboard queries metrics no service exports: {missing}"
