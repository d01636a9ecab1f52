"""``kvmesh bench router --auth both``: the same turns routed with and without the API-key scope."""

from __future__ import annotations

import json

from kvmesh_tools.cli.main import main


def test_bench_router_auth_both_reports_a_same_run_ratio(tmp_path) -> None:
    out = tmp_path / "router.json"
    assert main(["bench", "router", "--auth", "both", "--start-tokens", "6400", "--end-tokens", "12800",
                 "--noise-tokens", "2000", "--tokenize-samples", "0", "--auth-keys", "50",
                 "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["auth_keys"] == 50 and r["auth_decisions_differ"] == 0
    assert r["route_auth_on_p99_ms"] > 0 and r["route_auth_off_p99_ms"] > 0
    assert r["auth_on_over_off_p99"] == r["route_auth_on_p99_ms"] / r["route_auth_off_p99_ms"]
    assert "auth_p99_growth_le_10pct" in r["targets"]
