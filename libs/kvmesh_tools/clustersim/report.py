"""Human-facing output of a simulation: a rich table and PNG plots.

Why it exists: the JSON is for machines; a platform team reads the table (hit
rate against the ceilings, TTFT, balance) and the plots (hit rate over time per
policy, TTFT CDF) to decide.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvmesh_tools.plotting import plot_hit_rate_over_time, plot_ttft_cdf

COLUMNS = [
    ("prefix_hit_rate", "hit"), ("gpu_hit_rate", "gpu"), ("offload_hit_rate", "offload"),
    ("share_of_ceiling_pooled", "of pooled"), ("ttft_p50_s", "TTFT p50 s"), ("ttft_p90_s", "p90 s"),
    ("ttft_p99_s", "p99 s"), ("output_tok_per_s", "out tok/s"), ("load_imbalance", "imbalance"),
    ("preemptions", "preempt"), ("requests", "requests"), ("wall_s", "wall s"),
    # Turns sent away from their session's previous endpoint, and the share of all prompt tokens
    # that endpoint was predicted to hold beyond the new one (kvmesh_tools.moves_report).
    ("moved_requests", "moved"), ("moved_given_up_share", "gave up"),
    # Splits, and the prefill phases' hits their decode phases computed again (the store lost the transfer).
    ("split_requests", "splits"), ("split_lost_share", "split lost"),
]
# Mispredicted requests and their classes (kvmesh.routing.fidelity).
MISMATCH_COLUMNS = [("requests", "mispred"), ("evicted", "evicted"), ("filled", "filled"), ("lag", "lag"),
                    ("speculative", "spec"), ("view_bug", "view bug"), ("no_index", "no index"),
                    ("split", "split")]
# lookup_timeout and unknown are live-only classes (always 0 here): in the JSON, not the table.


def _console():
    import sys

    from rich.console import Console

    # Piped output (CI logs, files) gets a wide fixed width instead of 80 columns of wrapped cells.
    return Console() if sys.stdout.isatty() else Console(width=280)


def render_table(report: dict[str, Any], title: str = "kvmesh simulate") -> None:
    from rich.table import Table

    t = Table(title=f"{title}  (ceiling_infinite {report['ceiling_infinite']:.4f}, "
                    f"ceiling_pooled {report['ceiling_pooled']:.4f})")
    t.add_column("policy", no_wrap=True, min_width=max(len(p) for p in report["results"]) if report["results"] else 6)
    for _, name in COLUMNS + MISMATCH_COLUMNS:
        t.add_column(name, justify="right")
    for pol, m in report["results"].items():
        mm = m.get("mismatches") or {}
        t.add_row(pol, *[f"{m.get(k, '')}" for k, _ in COLUMNS], *[f"{mm.get(k, '')}" for k, _ in MISMATCH_COLUMNS])
    _console().print(t)


def render_seeds_table(agg: dict[str, Any], title: str = "kvmesh simulate") -> None:
    """One regime of :func:`kvmesh_tools.clustersim.seeds.aggregate`: a row per policy."""
    from rich.table import Table

    n = agg["seeds"]
    t = Table(title=f"{title}  ({n} seeds: mean hit rate, median TTFT, seeds with the best figure)")
    for name in ("policy", "hit mean", "hit min-max", "of pooled", "p50 s", "p90 s", "p99 s", "imbalance max",
                 "best hit", "best p50", "best p90", "best p99"):
        t.add_column(name, justify="left" if name == "policy" else "right")
    for pol, m in agg["policies"].items():
        b = m["best"]
        t.add_row(pol, f"{m['prefix_hit_rate_mean']:.4f}", f"{m['prefix_hit_rate_min']:.4f}-{m['prefix_hit_rate_max']:.4f}",
                  f"{m['share_of_ceiling_pooled_mean']:.4f}", f"{m['ttft_p50_s_median']}", f"{m['ttft_p90_s_median']}",
                  f"{m['ttft_p99_s_median']}", f"{m['load_imbalance_max']}",
                  *[f"{b[k]}/{n}" for k in ("hit", "ttft_p50", "ttft_p90", "ttft_p99")])
    _console().print(t)


def write_plots(report: dict[str, Any], out_dir: str | Path, prefix: str = "simulate") -> list[Path]:
    """hit rate over time per policy, and the TTFT CDF; returns the PNG paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    series = report["series"]
    return [
        plot_hit_rate_over_time({pol: [(t / 60.0, h) for t, h in s.get("hit_rate_over_time") or []]
                                 for pol, s in series.items()},
                                out / f"{prefix}_hit_rate.png", xlabel="time (min)",
                                ceiling=report["ceiling_pooled"]),
        plot_ttft_cdf({pol: s.get("ttft_s") or [] for pol, s in series.items()}, out / f"{prefix}_ttft_cdf.png"),
    ]
