"""``kvmesh bench tokenize`` runs end to end on a small conversation and finds no difference."""

from __future__ import annotations

import json

from kvmesh_tools.cli.main import main


def test_bench_tokenize_small(tmp_path) -> None:
    out = tmp_path / "tok.json"
    assert main(["bench", "tokenize", "--start-tokens", "20000", "--turns", "4", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["turns"] == 4 and r["differences"] == 0 and r["targets"]["no_differences"]
    assert r["outcomes"]["hit"] == 4 and r["tokens_last"] > r["tokens_first"] > 15_000
    assert r["full_over_incremental_p50"] > 1.0
