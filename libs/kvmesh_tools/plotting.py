"""PNG plots shared by ``kvmesh simulate`` and ``kvmesh replay``.

Both report the same two views — the TTFT CDF and the prefix hit rate over
time per policy — so they draw them with one set of functions and look alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the headless Agg backend (imported lazily: plotting is optional)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path) -> Path:
    plt = pyplot()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ttft_cdf(series: Mapping[str, Sequence[float]], path: Path, title: str = "TTFT CDF") -> Path:
    """One CDF line per run/policy, log-scaled TTFT on x."""
    fig, ax = pyplot().subplots(figsize=(8, 4.5))
    for name, values in series.items():
        xs = sorted(values)
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("share of requests")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return save(fig, path)


def plot_hit_rate_over_time(series: Mapping[str, Sequence[tuple[float, float]]], path: Path, *,
                            title: str = "Prefix hit rate over time", xlabel: str = "time (s)",
                            ylabel: str = "prefix hit rate (tokens)", ceiling: float | None = None,
                            marker: str | None = None) -> Path:
    """One line per run/policy of (time, hit rate) points, with an optional ceiling line."""
    fig, ax = pyplot().subplots(figsize=(8, 4.5))
    for name, pts in series.items():
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=name)
    if ceiling is not None:
        ax.axhline(ceiling, linestyle="--", color="grey", label="ceiling_pooled")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    return save(fig, path)
