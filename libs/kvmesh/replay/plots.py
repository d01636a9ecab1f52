"""PNG plots of a replay: TTFT CDF per run, hit rate over time, predicted vs actual cached tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_replay_plots(runs: dict[str, list[dict[str, Any]]], out_dir: str | Path, prefix: str = "replay") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, recs in runs.items():
        xs = sorted(r["ttft_s"] for r in recs if not r["error"] and r["ttft_s"] is not None)
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("share of requests")
    ax.set_title("TTFT CDF (live replay)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    p = out / f"{prefix}_ttft_cdf.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, recs in runs.items():
        ok = sorted((r for r in recs if not r["error"]), key=lambda r: r["sent_s"])
        if not ok:
            continue
        n = 20
        xs, ys = [], []
        for i in range(0, len(ok), max(1, len(ok) // n)):
            chunk = ok[i: i + max(1, len(ok) // n)]
            pt = sum(r["prompt_tokens"] for r in chunk)
            if pt:
                xs.append(chunk[-1]["sent_s"])
                ys.append(sum(r["cached"] for r in chunk) / pt)
        ax.plot(xs, ys, marker=".", label=name)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("prefix hit rate (reported cached tokens)")
    ax.set_title("Hit rate over time (live replay)")
    ax.legend()
    fig.tight_layout()
    p = out / f"{prefix}_hit_rate.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    fig, ax = plt.subplots(figsize=(5.5, 5))
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
    fig.tight_layout()
    p = out / f"{prefix}_predicted_vs_actual.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths
