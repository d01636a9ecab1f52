"""``kvmesh simulate --regimes``: the same traces with no store, a small and a large one, side by side."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh_tools.cli.cmd_simulate import DEFAULT_REGIMES, parse_regimes
from kvmesh_tools.clustersim import SimConfig, simulate_policies, simulate_regimes
from kvmesh_tools.clustersim.run import _longest_first
from kvmesh_tools.traffic.generator import GeneratorConfig, generate
from kvmesh_tools.traffic.native import write_native

pytestmark = pytest.mark.timeout(180)
POLICIES = ["precise", "session", "llmd", "dynamo"]


def _trace():
    return generate(GeneratorConfig(sessions=5, seed=2, turns_median=6, system_tokens=2048, first_user_tokens=400,
                                    growth_median=300, growth_p99=2000, output_median=16, output_p99=64,
                                    think_median_s=1.0, think_p99_s=10.0, max_context_tokens=12000,
                                    subagent_group_prob=0.2, group_max=4, subagent_system_tokens=1024,
                                    subagent_task_tokens=200, subagent_turns_median=3))


def _cfg(**kw) -> SimConfig:
    base = dict(decode_workers=3, prefill_workers=1, kv_capacity_tokens=8000, start_window_s=5.0, seed=3)
    base.update(kw)
    return SimConfig(**base)


def test_parse_regimes():
    assert parse_regimes(DEFAULT_REGIMES) == [("none", 0), ("4M", 4_000_000), ("32M", 32_000_000)]
    assert parse_regimes("0, 512k,1000") == [("0", 0), ("512k", 512_000), ("1000", 1000)]
    for bad in ("", "lots", "-4M", "4M,4M"):
        with pytest.raises(ValueError, match="--regimes"):
            parse_regimes(bad)


def test_each_regime_is_the_plain_run_with_that_store():
    regimes = [("none", 0), ("small", 20_000), ("large", 400_000)]
    rep = simulate_regimes(_trace(), _cfg(), POLICIES, regimes, jobs=2)
    assert [r["regime"] for r in rep["regimes"]] == ["none", "small", "large"]
    for r, (_, cap) in zip(rep["regimes"], regimes, strict=True):
        assert r["offload_capacity_tokens"] == cap == r["report"]["config"]["offload_capacity_tokens"]
        assert set(r["summary"]) == set(POLICIES)
        for m in r["summary"].values():
            for k in ("prefix_hit_rate", "ceiling_pooled", "share_of_ceiling_pooled", "ttft_p50_s", "ttft_p90_s",
                      "ttft_p99_s", "load_imbalance"):
                assert k in m
        # Each regime's figures are exactly what a plain run with that store gives.
        plain = simulate_policies(_trace(), _cfg(offload_capacity_tokens=cap), POLICIES, jobs=1)
        for p in POLICIES:
            got = dict(r["report"]["results"][p], wall_s=0)
            assert got == dict(plain["results"][p], wall_s=0)
    none, small, large = (r["report"] for r in rep["regimes"])
    assert all(m["offload_hit_rate"] == 0 for m in none["results"].values())
    # A larger store can only add to what the pooled capacity can hold.
    assert none["ceiling_pooled"] <= small["ceiling_pooled"] <= large["ceiling_pooled"]


def test_store_simulations_start_first_and_ceilings_last():
    """The parallel run starts the long simulations (with a store) first; results keep task order
    (the test above runs the regimes in parallel with the store-less one listed first)."""
    tasks = [("sim", "a", 0), ("sim", "b", 0), ("sim", "a", 4_000_000), ("sim", "b", None),
             ("ceiling", "", None), ("ceiling", "", 8000), ("sim", "c", 32_000_000)]
    assert _longest_first(tasks, _cfg(offload_capacity_tokens=0)) == [2, 6, 0, 1, 3, 4, 5]
    # A task without its own capacity takes the config's.
    assert _longest_first(tasks, _cfg(offload_capacity_tokens=1000)) == [2, 3, 6, 0, 1, 4, 5]


def test_cli_prints_a_table_per_regime_and_writes_one_json(tmp_path: Path):
    trace_path = write_native(_trace(), tmp_path / "t.jsonl", hash_id_scope="global")
    out = tmp_path / "sim.json"
    r = subprocess.run([sys.executable, "-m", "kvmesh_tools.cli.main", "simulate", "--trace", str(trace_path),
                        "--format", "native", "--decode-workers", "3", "--prefill-workers", "1",
                        "--kv-capacity-tokens", "8000", "--policy", "llmd,dynamo", "--seed", "3",
                        "--start-window-s", "5", "--regimes", "none,50k", "--json", str(out), "--jobs", "2"],
                       capture_output=True, text=True, timeout=170)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert [x["regime"] for x in rep["regimes"]] == ["none", "50k"]
    assert rep["regimes"][1]["offload_capacity_tokens"] == 50_000
    assert "regime none (no offload)" in r.stdout and "regime 50k (50,000-token store)" in r.stdout
    assert r.stdout.count("dynamo") >= 2
    bad = subprocess.run([sys.executable, "-m", "kvmesh_tools.cli.main", "simulate", "--trace", str(trace_path),
                          "--format", "native", "--regimes", "big"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--regimes" in bad.stdout
