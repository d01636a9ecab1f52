"""``kvmesh soak``: N concurrent agent sessions for T minutes against a running ``kvmesh up`` stack."""

from __future__ import annotations

import argparse
import asyncio

from kvmesh.config import ConfigError, add_dataclass_args, load_config
from kvmesh_tools.soak.driver import SoakConfig


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("soak", help="hold N agent sessions for T minutes against a running stack; per-minute "
                                    "errors, TTFT, hit rate, prediction accuracy, RSS of every service (JSON + PNG)")
    add_dataclass_args(p, SoakConfig)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from kvmesh_tools.soak.driver import run_soak
    from kvmesh_tools.soak.report import summarize, write

    try:
        cfg = load_config(SoakConfig, args)
        run = asyncio.run(run_soak(cfg))
    except (ConfigError, ValueError, OSError, RuntimeError) as exc:
        print(f"error: {exc}")
        return 2
    report = summarize(run)
    jpath, ppath = write(report, cfg.out)
    t = report["total"]
    print(f"soak: {t['requests']} requests, {t['errors']} errors, TTFT p50 {t['ttft_p50_s']} p99 {t['ttft_p99_s']} s, "
          f"hit {t['hit_rate']}, predicted==actual {t['prediction_accuracy']} "
          f"({t['prediction_accuracy_unsplit']} of unsplit requests), mispredicted {t['mismatches']}")
    if t["errors"]:
        print(f"errors by kind: {t['error_kinds']} (each in soak.json 'failures')")
    print(f"RSS last/ref minute: {report['rss_last_over_ref']}")
    print(f"wrote {jpath} and {ppath}")
    return 1 if t["errors"] else 0
