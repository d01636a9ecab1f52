"""``kvmesh bench offload-policy --json PATH``: eviction policies of the offload RAM tier on real agent traces.

Replays the Claude Code traces (never copied into the repo; read from
``--traces``) through the RAM tier with each policy at a few capacities
(fractions of the distinct blocks) and reports the prefix hit rate, next to the
infinite-cache ceiling.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from kvmesh_tools.bench.common import write_json
from kvmesh_tools.policysim import infinite_hit_rate, iter_capacities, load_claude_code, replay

log = logging.getLogger(__name__)
DEFAULT_TRACES = Path(__file__).resolve().parents[3].parent / "shared" / "traces" / "claude-code"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("offload-policy", help="offload eviction policies (agent vs lru) on Claude Code traces")
    p.add_argument("--json", default=None)
    p.add_argument("--traces", default=str(DEFAULT_TRACES), help="folder of claude-code *.json.gz")
    p.add_argument("--max-sessions", type=int, default=0, help="0 = all")
    p.add_argument("--stagger-s", type=float, default=60.0, help="start offset between sessions")
    p.add_argument("--fractions", default="0.03,0.1,0.3", help="capacities as fractions of distinct blocks")
    p.add_argument("--policies", default="lru,agent,greedy-dual,session-rate")
    p.add_argument("--depth-cost-s", type=float, default=None, help="agent policy: seconds of recency per block of depth")
    p.add_argument("--share-s", type=float, default=None, help="agent policy: seconds of credit per log2(sharers)")
    p.add_argument("--backend", choices=["kvmesh", "mooncake"], default="kvmesh",
                   help="mooncake: also replay each policy through the store core, built-in and over a real "
                        "Mooncake pool, and compare their hit rates (see kvmesh_tools.bench.offload_policy_pool)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    folder = Path(args.traces)
    if not folder.is_dir():
        log.error("trace folder not found", extra={"path": str(folder)})
        return 2
    reqs = load_claude_code(folder, args.max_sessions, args.stagger_s)
    ceiling, unique = infinite_hit_rate(reqs)
    master = None
    if args.backend == "mooncake":
        from kvmesh_tools.testing.mooncake import MooncakeMaster

        master = MooncakeMaster(extra_args=["--default_kv_lease_ttl=1000"]).start()
    try:
        rows = _rows(args, reqs, unique, master)
    finally:
        if master is not None:
            master.stop()
    out = write_json(args.json, {"bench": "offload-policy", "requests": len(reqs), "distinct_blocks": unique,
                                 "infinite_cache_hit_rate": ceiling, "block_tokens": 64, "rows": rows,
                                 "backend": args.backend,
                                 "sessions": args.max_sessions or "all", "stagger_s": args.stagger_s,
                                 "agent_params": {"depth_cost_s": args.depth_cost_s, "share_s": args.share_s}})
    print({"infinite_cache_hit_rate": round(out["infinite_cache_hit_rate"], 4), "distinct_blocks": unique})
    return 0


def _rows(args: argparse.Namespace, reqs: list, unique: int, master: object) -> list[dict[str, object]]:
    rows = []
    fractions = [float(x) for x in args.fractions.split(",") if x.strip()]
    for frac, cap in iter_capacities(unique, fractions):
        row: dict[str, object] = {"fraction": frac, "capacity_blocks": cap}
        for pol in [p.strip() for p in args.policies.split(",") if p.strip()]:
            t0 = time.perf_counter()
            kw = {k: v for k, v in (("depth_cost_s", args.depth_cost_s), ("share_s", args.share_s))
                  if v is not None} if pol == "agent" else {}
            r = replay(reqs, pol, cap, **kw)
            row[f"hit_rate_{pol}"] = r.hit_rate
            row[f"evictions_{pol}"] = r.evictions
            row[f"seconds_{pol}"] = time.perf_counter() - t0
            log.info("policy replay", extra={"policy": pol, "fraction": frac, "hit_rate": round(r.hit_rate, 4)})
            if master is not None:
                from kvmesh_tools.bench.offload_policy_pool import replay_pooled, replay_store

                store = replay_store(reqs, pol, cap)
                pool = replay_pooled(reqs, pol, cap, master.address, f"bench-{pol}-{cap}")  # type: ignore[attr-defined]
                row[f"store_hit_rate_{pol}"] = store.hit_rate
                row[f"pool_hit_rate_{pol}"] = pool.hit_rate
                row[f"pool_minus_store_{pol}"] = pool.hit_rate - store.hit_rate
                row[f"pool_holes_{pol}"] = pool.holes
                row[f"pool_seconds_{pol}"] = pool.seconds
                log.info("pooled replay", extra={"policy": pol, "fraction": frac, "store": round(store.hit_rate, 4),
                                                 "pool": round(pool.hit_rate, 4), "holes": pool.holes})
        if "hit_rate_lru" in row and "hit_rate_agent" in row:
            row["agent_minus_lru"] = float(row["hit_rate_agent"]) - float(row["hit_rate_lru"])  # type: ignore[arg-type]
        rows.append(row)
        print(row)
    return rows
