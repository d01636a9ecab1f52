"""A soak's per-minute table and summary (JSON) and its four-panel PNG."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kvmesh.routing.fidelity import count

MiB = 1 << 20


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    return round(xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))], 4)


def _stats(recs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in recs if not r["error"]]
    prompt = sum(r["prompt_tokens"] for r in ok)
    pred = [r for r in ok if r["predicted"] is not None]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    out: dict[str, Any] = {
        "requests": len(recs), "errors": len(recs) - len(ok),
        "ttft_p50_s": _pct(ttft, 50), "ttft_p90_s": _pct(ttft, 90), "ttft_p99_s": _pct(ttft, 99),
        "hit_rate": round(sum(r.get("reused", r["cached"]) for r in ok) / prompt, 4) if prompt else None,
        # Share of requests whose predicted cached tokens equal the engine's count.
        "prediction_accuracy": round(sum(1 for r in pred if r["predicted"] == r["cached"]) / len(pred), 4)
        if pred else None,
        "mismatches": count([r["mismatch"] for r in pred]),
        "error_kinds": error_kinds(recs),
    }
    # A split request's prediction is its decode endpoint's cache once the prefill endpoint's KV
    # has arrived; the requests that were not split measure the index (and the local view) alone.
    # (Older records carry no "split": a miss classed "split" is then the only sign of one.)
    unsplit = [r for r in pred if not r.get("split", r["mismatch"] == "split")]
    out["prediction_accuracy_unsplit"] = (round(sum(1 for r in unsplit if r["predicted"] == r["cached"])
                                                / len(unsplit), 4) if unsplit else None)
    return out


def error_kind(rec: dict[str, Any]) -> str:
    """A failure's class: ``Type@phase`` (plus ``errno N``) for a transport error, else its message's head."""
    d = rec.get("error_detail")
    if not d:
        return str(rec["error"]).split(":")[0][:60]
    kind = f"{d.get('type')}@{d.get('phase')}"
    if d.get("errno") is not None:
        kind += f" errno {d['errno']}"
    return kind


def error_kinds(recs: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in recs:
        if r["error"]:
            k = error_kind(r)
            out[k] = out.get(k, 0) + 1
    return out


def minute_rows(records: list[dict[str, Any]], samples: list[dict[str, Any]], minutes: float) -> list[dict[str, Any]]:
    """One row per started minute: request figures by send time, RSS (MiB) as the minute's peak."""
    n = max(1, math.ceil(minutes))
    rows = []
    for m in range(n):
        recs = [r for r in records if m * 60 <= r["sent_s"] < (m + 1) * 60]
        rss: dict[str, float | None] = {}
        shmem: dict[str, float | None] = {}
        for s in samples:
            if m * 60 <= s["t_s"] <= (m + 1) * 60 + 1e-6:
                for name, v in s["rss"].items():
                    if v is not None:
                        rss[name] = max(rss.get(name) or 0.0, round(v / MiB, 1))
                # Of that, pages of shared segments (the store's slabs a worker maps); older runs lack it.
                for name, v in (s.get("rss_shmem") or {}).items():
                    if v is not None:
                        shmem[name] = max(shmem.get(name) or 0.0, round(v / MiB, 1))
        rows.append({"minute": m + 1, **_stats(recs), "rss_mib": rss, "rss_shmem_mib": shmem})
    return rows


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    records, samples = run["records"], run["samples"]
    rows = minute_rows(records, samples, run["config"]["minutes"])
    total = _stats(records)
    # Growth per service: the last minute's peak RSS over the first full minute's (minute 10's
    # for runs of 10 minutes or more, as issue 21's target reads).
    ref = 9 if len(rows) >= 11 else 0
    growth = {}
    for name in rows[-1]["rss_mib"]:
        a, b = rows[ref]["rss_mib"].get(name), rows[-1]["rss_mib"].get(name)
        growth[name] = round(b / a, 3) if a and b else None
    # Every failed request with its exception chain, phase and time: an error must be explained.
    failures = [r for r in records if r["error"]]
    return {"config": run["config"], "stack": run["stack"], "total": total, "minutes": rows,
            "rss_last_over_ref": growth, "rss_ref_minute": ref + 1, "failures": failures}


def write(report: dict[str, Any], out_dir: str | Path) -> tuple[Path, Path]:
    import json

    from kvmesh_tools.plotting import pyplot, save

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jpath = out / "soak.json"
    jpath.write_text(json.dumps(report, indent=1))
    rows = report["minutes"]
    xs = [r["minute"] for r in rows]
    fig, axes = pyplot().subplots(2, 2, figsize=(12, 8))
    a = axes[0][0]
    a.bar(xs, [r["requests"] for r in rows], label="requests", alpha=0.5)
    a.bar(xs, [r["errors"] for r in rows], label="errors", color="red")
    a.set_title("requests and errors per minute")
    a.legend()
    a = axes[0][1]
    for q in ("p50", "p90", "p99"):
        a.plot(xs, [r[f"ttft_{q}_s"] for r in rows], marker="o", label=f"TTFT {q}")
    a.set_title("TTFT (s)")
    a.legend()
    a = axes[1][0]
    a.plot(xs, [r["hit_rate"] for r in rows], marker="o", label="hit rate")
    a.plot(xs, [r["prediction_accuracy"] for r in rows], marker="o", label="predicted == actual")
    a.set_ylim(0, 1.02)
    a.set_title("hit rate and prediction accuracy")
    a.legend()
    a = axes[1][1]
    for name in sorted(rows[-1]["rss_mib"]):
        a.plot(xs, [r["rss_mib"].get(name) for r in rows], marker=".", label=name)
    a.set_title("RSS per service (MiB, minute peak)")
    a.legend(fontsize=7)
    for ax in axes.flat:
        ax.set_xlabel("minute")
        ax.grid(True, alpha=0.3)
    ppath = save(fig, out / "soak.png")
    return jpath, ppath
