"""PNG plots of a replay: TTFT CDF per run, hit rate over time, predicted vs actual cached tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvmesh_tools.plotting import plot_hit_rate_over_time, plot_ttft_cdf, pyplot, save


def _hit_rate_points(recs: list[dict[str, Any]], buckets: int = 20) -> list[tuple[float, float]]:
    ok = sorted((r for r in recs if not r["error"]), key=lambda r: r["sent_s"])
    step = max(1, len(ok) // buckets)
    pts = []
    for i in range(0, len(ok), step):
        chunk = ok[i: i + step]
        pt = sum(r["prompt_tokens"] for r in chunk)
        if pt:
            pts.append((chunk[-1]["sent_s"], sum(r.get("reused", r["cached"]) for r in chunk) / pt))
    return pts


def write_replay_plots(runs: dict[str, list[dict[str, Any]]], out_dir: str | Path, prefix: str = "replay") -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [
        plot_ttft_cdf({name: [r["ttft_s"] for r in recs if not r["error"] and r["ttft_s"] is not None]
                       for name, recs in runs.items()},
                      out / f"{prefix}_ttft_cdf.png", title="TTFT CDF (live replay)"),
        plot_hit_rate_over_time({name: _hit_rate_points(recs) for name, recs in runs.items()},
                                out / f"{prefix}_hit_rate.png", title="Hit rate over time (live replay)",
                                ylabel="prefix hit rate (reported cached tokens)", marker="."),
    ]

    fig, ax = pyplot().subplots(figsize=(5.5, 5))
    hi = 1
    for name, recs in runs.items():
        pts = [(r["predicted"], r["cached"]) for r in recs if not r["error"] and r["predicted"] is not None]
        if pts:
            ax.scatter([p for p, _ in pts], [a for _, a in pts], s=8, alpha=0.6, label=name)
            hi = max(hi, max(max(p, a) for p, a in pts))
    ax.plot([0, hi], [0, hi], color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("predicted cached tokens (router)")
    ax.set_ylabel("actual cached tokens (engine)")
    ax.set_title("Predicted vs actual")
    ax.legend()
    paths.append(save(fig, out / f"{prefix}_predicted_vs_actual.png"))
    return paths
