"""The hashing and events benchmarks run and write the JSON fields the reports rely on."""

from __future__ import annotations

import json

import pytest

from kvmesh_tools.cli.main import main

pytestmark = pytest.mark.timeout(120)


def test_bench_hashing_writes_json(tmp_path) -> None:
    out = tmp_path / "hashing.json"
    rc = main(["bench", "hashing", "--json", str(out), "--tokens", "4000", "--repeats", "1", "--no-vllm",
               "--block-sizes", "16", "--algos", "sha256", "sha256_cbor"])  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    rows = {r["algo"]: r for r in data["results"]}
    assert set(rows) == {"sha256", "sha256_cbor"}
    for r in rows.values():
        assert r["tokens"] == 4000 and r["ms_median"] > 0 and r["tokens_per_s"] > 0 and r["speedup_vs_naive"] > 0
    assert "calibration_sum_ms" in data and "machine" in data


def test_bench_events_writes_json(tmp_path) -> None:
    out = tmp_path / "events.json"
    assert main(["bench", "events", "--json", str(out), "--events", "10", "--repeats", "2", "--no-vllm"]) == 0
    data = json.loads(out.read_text())
    assert data["events_per_batch"] == 20 and data["decode_ms_median"] > 0 and data["decode_events_per_s"] > 0
