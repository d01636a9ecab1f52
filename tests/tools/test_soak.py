"""``kvmesh soak`` against a real local stack: per-minute figures, RSS of every service, JSON + PNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh_tools.stack.launcher import LocalStack, StackConfig

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def test_soak_prompts_fit_a_small_stack_many_times_over() -> None:
    """The soak's sessions are sized for small stacks; the demo's long prompts would not fit.

    The demo's prompts grew 4x once and the soak, which then borrowed the demo's shape, sent
    prompts larger than the 512-block worker below (HTTP 400 "prompt needs 535 KV blocks")."""
    from kvmesh_tools.traffic.shapes import long_agent_sessions, short_agent_sessions

    block_tokens = StackConfig().block_size
    for seed in range(5):
        longest = max(r.input_tokens for r in short_agent_sessions(1, seed).requests())
        assert longest * 2 <= 512 * block_tokens, (seed, longest)
    assert max(r.input_tokens for r in long_agent_sessions(1, 0).requests()) > 512 * block_tokens // 2


def test_a_short_soak_reports_each_minute_and_every_service(tmp_path: Path) -> None:
    cfg = StackConfig(decode_workers=2, prefill_workers=0, redis="off", time_scale=20.0, num_blocks=512,
                      log_dir=str(tmp_path / "stack"), offload_ram_bytes=64 << 20)
    with LocalStack(cfg) as stack:
        desc = stack.write_description()
        pids = json.loads(desc.read_text())["pids"]
        assert {"indexer", "offload", "decode-0", "decode-1"} <= set(pids), pids
        out = tmp_path / "soak"
        proc = subprocess.run(
            [sys.executable, "-m", "kvmesh_tools.cli.main", "soak", "--stack", str(desc), "--sessions", "6",
             "--minutes", "0.4", "--sample-s", "2", "--out", str(out), "--max-output-tokens", "8"],
            capture_output=True, text=True, timeout=200)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads((out / "soak.json").read_text())
    assert (out / "soak.png").stat().st_size > 0
    t = rep["total"]
    assert t["requests"] > 6 and t["errors"] == 0
    assert t["hit_rate"] > 0 and t["prediction_accuracy"] is not None and t["prediction_accuracy_unsplit"] is not None
    assert t["mismatches"]["view_bug"] == 0, t["mismatches"]
    (row,) = rep["minutes"]
    assert row["requests"] == t["requests"] and row["ttft_p50_s"] is not None
    # Every service's memory was sampled.
    assert set(pids) <= set(row["rss_mib"]) and all(v > 0 for v in row["rss_mib"].values()), row["rss_mib"]
    # ... with its shared-memory part apart (a worker's mapped store slabs are not its own growth).
    assert set(pids) <= set(row["rss_shmem_mib"]), row["rss_shmem_mib"]
    assert all(row["rss_shmem_mib"][k] <= row["rss_mib"][k] for k in pids)
