"""``kvmesh bench router --http only``: the whole decision over HTTP on a real local stack, small."""

from __future__ import annotations

import json

import pytest

from kvmesh_tools.cli.main import main

pytestmark = pytest.mark.timeout(300)


def test_bench_router_http_reports_the_decision_and_its_same_run_baseline(tmp_path) -> None:
    out = tmp_path / "router-http.json"
    assert main(["bench", "router", "--http", "only", "--http-start-tokens", "20000", "--http-turns", "2",
                 "--http-workers", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["http_turns"] == 2 and r["http_tokens_last"] > r["http_tokens_first"] > 15_000
    assert r["http_prompt_length_differences"] == 0
    # Every timed turn of the session was tokenized incrementally; the baseline's were full.
    assert r["http_tokenize_outcomes"]["hit"] == 2 and r["http_tokenize_outcomes"]["miss"] == 2
    assert 0 < r["http_render_tokenize_p50_ms"] <= r["http_pipeline_p50_ms"] <= r["http_decision_p50_ms"]
    assert r["http_full_over_incremental_p50"] == r["http_decision_full_tokenize_p50_ms"] / r["http_decision_p50_ms"]
    assert set(r["targets"]) == {"http_decision_p50_le_25ms", "http_same_prompt_both_ways"}
