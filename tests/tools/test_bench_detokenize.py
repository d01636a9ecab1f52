"""``kvmesh bench detokenize`` runs end to end on short answers and finds no difference."""

from __future__ import annotations

import json

from kvmesh_tools.cli.main import main


def test_bench_detokenize_small(tmp_path) -> None:
    out = tmp_path / "detok.json"
    assert main(["bench", "detokenize", "--lengths", "50,200", "--reps", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["differences"] == 0 and r["targets"]["no_differences"]
    assert r["incremental_200_p50_ms"] > 0 and r["whole_200_p50_ms"] > 0
