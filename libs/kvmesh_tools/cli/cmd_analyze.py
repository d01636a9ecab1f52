"""``kvmesh analyze TRACE...``: traffic shape, reuse, sub-agent bursts and the two hit-rate ceilings."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("analyze", help="describe a trace: sizes, reuse, bursts, hit-rate ceilings")
    p.add_argument("trace", nargs="+", metavar="TRACE", help="trace files or directories")
    p.add_argument("--format", default="weka", choices=["weka", "claude-code", "mooncake", "native"])
    p.add_argument("--pooled-capacity-tokens", type=int, default=40_000_000,
                   help="capacity of the pooled LRU for ceiling_pooled (default 40M = 8x1M GPU + 32M offload)")
    p.add_argument("--start-window-s", type=float, default=None, help="spread session starts over this window")
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="also write the JSON here")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from kvmesh_tools.traffic.analyze import analyze
    from kvmesh_tools.traffic.readers import TraceFormatError, load_trace
    from kvmesh_tools.traffic.schedule import ScheduleOptions

    if args.pooled_capacity_tokens < 0:
        print("error: --pooled-capacity-tokens must be >= 0")
        return 2
    try:
        trace = load_trace(args.trace, args.format)
    except TraceFormatError as exc:
        print(f"error: {exc}")
        return 2
    rep = analyze(trace, args.pooled_capacity_tokens, ScheduleOptions(start_window_s=args.start_window_s))
    text = json.dumps(rep, indent=1)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(text)
    print(text)
    return 0
