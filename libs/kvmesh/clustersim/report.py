"""Human-facing output of a simulation: a rich table and PNG plots.

Why it exists: the JSON is for machines; a platform team reads the table (hit
rate against the ceilings, TTFT, balance) and the plots (hit rate over time per
policy, TTFT CDF) to decide.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLUMNS = [
    ("prefix_hit_rate", "hit"), ("gpu_hit_rate", "gpu"), ("offload_hit_rate", "offload"),
    ("share_of_ceiling_pooled", "of pooled"), ("ttft_p50_s", "TTFT p50 s"), ("ttft_p90_s", "p90 s"),
    ("ttft_p99_s", "p99 s"), ("output_tok_per_s", "out tok/s"), ("load_imbalance", "imbalance"),
    ("preemptions", "preempt"), ("requests", "requests"), ("wall_s", "wall s"),
]


def _console():
    import sys

    from rich.console import Console

    # Piped output (CI logs, files) gets a wide fixed width instead of 80 columns of wrapped cells.
    return Console() if sys.stdout.isatty() else Console(width=200)


def render_table(report: dict[str, Any], title: str = "kvmesh simulate") -> None:
    from rich.table import Table

    t = Table(title=f"{title}  (ceiling_infinite {report['ceiling_infinite']:.4f}, "
                    f"ceiling_pooled {report['ceiling_pooled']:.4f})")
    t.add_column("policy")
    for _, name in COLUMNS:
        t.add_column(name, justify="right")
    for pol, m in report["results"].items():
        t.add_row(pol, *[f"{m.get(k, '')}" for k, _ in COLUMNS])
    _console().print(t)


def write_plots(report: dict[str, Any], out_dir: str | Path, prefix: str = "simulate") -> list[Path]:
    """hit rate over time per policy, and the TTFT CDF; returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for pol, s in report["series"].items():
        pts = s.get("hit_rate_over_time") or []
        if pts:
            ax.plot([p[0] / 60.0 for p in pts], [p[1] for p in pts], label=pol)
    ax.axhline(report["ceiling_pooled"], linestyle="--", color="grey", label="ceiling_pooled")
    ax.set_xlabel("time (min)")
    ax.set_ylabel("prefix hit rate (tokens)")
    ax.set_ylim(0, 1.02)
    ax.set_title("Prefix hit rate over time")
    ax.legend()
    fig.tight_layout()
    p = out / f"{prefix}_hit_rate.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for pol, s in report["series"].items():
        xs = s.get("ttft_s") or []
        if xs:
            n = len(xs)
            ax.plot(xs, [(i + 1) / n for i in range(n)], label=pol)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("share of requests")
    ax.set_title("TTFT CDF")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    p = out / f"{prefix}_ttft_cdf.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths
