"""The simulate and replay plot writers produce real PNGs from small reports."""

from __future__ import annotations

from pathlib import Path

from kvmesh_tools.clustersim.report import write_plots
from kvmesh_tools.replay.plots import write_replay_plots

PNG = b"\x89PNG\r\n\x1a\n"


def test_simulate_plots(tmp_path: Path) -> None:
    report = {"ceiling_pooled": 0.9, "series": {
        "precise": {"hit_rate_over_time": [(0.0, 0.5), (60.0, 0.8)], "ttft_s": [0.1, 0.2, 1.5]},
        "approx": {"hit_rate_over_time": [], "ttft_s": []}}}
    paths = write_plots(report, tmp_path)
    assert [p.name for p in paths] == ["simulate_hit_rate.png", "simulate_ttft_cdf.png"]
    assert all(p.read_bytes().startswith(PNG) for p in paths)


def test_replay_plots(tmp_path: Path) -> None:
    recs = [{"error": None, "ttft_s": 0.1 * (i + 1), "sent_s": float(i), "prompt_tokens": 100, "cached": 10 * i,
             "predicted": 10 * i} for i in range(10)]
    recs.append({"error": "boom", "ttft_s": None, "sent_s": 11.0, "prompt_tokens": 100, "cached": 0, "predicted": None})
    paths = write_replay_plots({"precise": recs}, tmp_path)
    assert {p.name for p in paths} == {"replay_ttft_cdf.png", "replay_hit_rate.png", "replay_predicted_vs_actual.png"}
    assert all(p.read_bytes().startswith(PNG) for p in paths)
