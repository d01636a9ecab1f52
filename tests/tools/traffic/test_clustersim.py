"""The virtual-time simulator: determinism, sane accounting, policy contrasts, the CLI."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.routing.scoring import ScoringConfig
from kvmesh_tools.clustersim import SimConfig, simulate_policies
from kvmesh_tools.traffic.generator import GeneratorConfig, generate
from kvmesh_tools.traffic.native import write_native

pytestmark = pytest.mark.timeout(120)


def _trace(seed: int = 1):
    return generate(GeneratorConfig(sessions=6, seed=seed, turns_median=8, system_tokens=2048,
                                    first_user_tokens=400, growth_median=200, growth_p99=2000,
                                    output_median=16, output_p99=64, think_median_s=1.0, think_p99_s=20.0,
                                    max_context_tokens=12000, subagent_group_prob=0.2, group_max=8,
                                    subagent_system_tokens=1024, subagent_task_tokens=200,
                                    subagent_turns_median=3))


def _cfg(**kw) -> SimConfig:
    base = dict(decode_workers=3, prefill_workers=1, kv_capacity_tokens=20000, offload_capacity_tokens=200000,
                start_window_s=5.0, seed=3)
    base.update(kw)
    return SimConfig(**base)


def _strip(rep: dict) -> dict:
    rep = json.loads(json.dumps(rep))
    rep.pop("wall_s")
    for m in rep["results"].values():
        m.pop("wall_s")
    return rep


def test_same_seed_same_json() -> None:
    tr = _trace()
    a = simulate_policies(tr, _cfg(), ["precise", "round_robin", "random"], jobs=1)
    b = simulate_policies(_trace(), _cfg(), ["precise", "round_robin", "random"], jobs=2)
    assert _strip(a) == _strip(b)
    c = simulate_policies(_trace(), _cfg(seed=4), ["random"], jobs=1)
    assert _strip(c)["results"]["random"] != _strip(a)["results"]["random"]


@pytest.mark.parametrize("bad_at", [0, 1, 3])
def test_a_failing_simulation_fails_the_parallel_run(bad_at: int) -> None:
    """With jobs > 1 this process and a pool share the tasks; a simulation that raises, in
    either, ends the run with its error instead of a hang or a missing result."""
    policies = ["round_robin", "precise", "random", "least_load"]
    policies[bad_at] = "no-such-policy"
    with pytest.raises(ValueError, match="no-such-policy"):
        simulate_policies(_trace(), _cfg(), policies, jobs=2)
    with pytest.raises(ValueError, match="no-such-policy"):
        simulate_policies(_trace(), _cfg(), policies, jobs=3)


def test_accounting_and_contract_keys() -> None:
    rep = simulate_policies(_trace(), _cfg(), ["precise", "round_robin"], jobs=1)
    n = len(_trace().requests())
    for m in rep["results"].values():
        for k in ("prefix_hit_rate", "gpu_hit_rate", "offload_hit_rate", "ceiling_infinite", "ceiling_pooled",
                  "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "output_tok_per_s", "requests", "load_imbalance",
                  "preemptions"):
            assert k in m
        assert m["requests"] == n and m["errors"] == 0
        assert m["prefix_hit_rate"] == pytest.approx(m["gpu_hit_rate"] + m["offload_hit_rate"], abs=2e-4)
        assert 0 < m["prefix_hit_rate"] <= m["ceiling_infinite"] + 1e-9
        assert m["ttft_p50_s"] <= m["ttft_p90_s"] <= m["ttft_p99_s"]
    # precise routes by cache contents: more GPU hits than cache-blind round robin
    assert rep["results"]["precise"]["gpu_hit_rate"] > rep["results"]["round_robin"]["gpu_hit_rate"]


def test_moved_turns_are_counted_with_their_reuse() -> None:
    """A turn routed away from its session's previous endpoint is a move: sticky ``session``
    never moves, round robin does, and the moved turns' reuse is theirs alone. What a move gave
    up is what the policy's own view predicted at the previous endpoint beyond the chosen one:
    nothing for cache-blind round robin, and without an offload store (which every endpoint
    restores from alike) something for Dynamo's cost, which moves turns off endpoints that hold
    them when their decode load is higher."""
    rep = simulate_policies(_trace(), _cfg(offload_capacity_tokens=0), ["session", "round_robin", "dynamo"],
                            jobs=1, records=True)
    assert rep["results"]["session"]["moved_requests"] == 0
    assert rep["results"]["session"]["moved_hit_rate"] == 0.0
    assert rep["results"]["session"]["moved_given_up_share"] == 0.0
    for pol in ("round_robin", "dynamo"):
        m = rep["results"][pol]
        done = [r for r in rep["records"][pol] if r["ttft_s"] is not None and not r["error"]]
        moved = [r for r in done if r["moved"]]
        assert m["moved_requests"] == len(moved) > 0
        prompt = sum(r["prompt"] for r in moved)
        assert m["moved_hit_rate"] == round(sum(r["cached_gpu"] + r["cached_offload"] for r in moved) / prompt, 4)
        assert m["moved_prompt_share"] == round(prompt / m["prompt_tokens"], 4)
        assert 0 < m["moved_prompt_share"] < 1
        assert all(r["given_up"] == 0 for r in done if not r["moved"])
        assert m["moved_given_up_share"] == round(sum(r["given_up"] for r in moved) / m["prompt_tokens"], 4)
        assert m["moved_given_up_share"] <= m["moved_prompt_share"]
    assert rep["results"]["round_robin"]["moved_given_up_share"] == 0.0   # no view, nothing predicted
    assert rep["results"]["dynamo"]["moved_given_up_share"] > 0.0


def test_corpus_rows_with_an_empty_prompt_or_no_output_are_simulated(tmp_path: Path) -> None:
    """Published Claude Code corpora hold rows with ``out`` 0 (and could hold ``in`` 0) and
    sub-agents launched without waiting: every policy runs them to the end, without errors."""
    from kvmesh_tools.traffic.readers import load_trace

    def req(t: float, n_in: int, n_out: int) -> dict:
        return {"t": t, "type": "n", "model": "m", "in": n_in, "out": n_out,
                "hash_ids": list(range(-(-n_in // 64))), "api_time": 1.0, "think_time": 1.0}
    sub = {"t": 12.0, "type": "subagent", "agent_id": "x", "subagent_type": "Explore", "duration_ms": None,
           "status": "async_launched", "models": ["m"], "requests": [req(12.0, 128, 3)]}
    doc = {"id": "z", "models": ["m"], "block_size": 64, "hash_id_scope": "local",
           "requests": [req(0.0, 640, 0), req(5.0, 0, 5), sub, req(13.0, 768, 4)]}
    (tmp_path / "corpus.jsonl").write_text(json.dumps(doc) + "\n")
    rep = simulate_policies(load_trace([tmp_path / "corpus.jsonl"], "weka"), _cfg(),
                            ["precise", "session", "llmd", "dynamo"], jobs=1)
    for m in rep["results"].values():
        assert m["requests"] == 4 and m["errors"] == 0


def test_offload_serves_what_gpus_evicted() -> None:
    tr = _trace()
    no = simulate_policies(tr, _cfg(offload_capacity_tokens=0, prefill_workers=0), ["round_robin"], jobs=1)
    yes = simulate_policies(_trace(), _cfg(prefill_workers=0), ["round_robin"], jobs=1)
    assert no["results"]["round_robin"]["offload_hit_rate"] == 0.0
    assert yes["results"]["round_robin"]["offload_hit_rate"] > 0.0
    assert yes["results"]["round_robin"]["prefix_hit_rate"] > no["results"]["round_robin"]["prefix_hit_rate"]
    m = no["results"]["round_robin"]
    assert m["offload_blocks_stored"] == m["offload_evictions"] == m["offload_refused_puts"] == 0
    # A store too small for the sessions' contexts churns, and holds at most its capacity.
    small = simulate_policies(_trace(), _cfg(prefill_workers=0, offload_capacity_tokens=4000), ["round_robin"],
                              jobs=1)["results"]["round_robin"]
    assert small["offload_evictions"] > 0
    assert 0 < small["offload_blocks_stored"] - small["offload_evictions"] <= 4000 // _trace().block_size


def test_cli_writes_json_and_plots(tmp_path: Path) -> None:
    trace_path = write_native(_trace(), tmp_path / "t.jsonl", hash_id_scope="global")
    out = tmp_path / "sim.json"
    r = subprocess.run([sys.executable, "-m", "kvmesh_tools.cli.main", "simulate", "--trace", str(trace_path),
                        "--format", "native", "--decode-workers", "3", "--prefill-workers", "1",
                        "--kv-capacity-tokens", "20000", "--offload-capacity-tokens", "200000",
                        "--policy", "precise,least_load", "--seed", "3", "--start-window-s", "5",
                        "--json", str(out), "--jobs", "1"], capture_output=True, text=True, timeout=110)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert set(rep["results"]) == {"precise", "least_load"}
    # The report's config is the settings, every one and nothing else (not the env prefix).
    assert set(rep["config"]) == {f.name for f in dataclasses.fields(SimConfig)} - {"scoring"}
    assert rep["config"]["seed"] == 3 and rep["config"]["decode_workers"] == 3
    assert all(Path(p).exists() and Path(p).stat().st_size > 1000 for p in rep["plots"])
    assert "precise" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "kvmesh_tools.cli.main", "simulate", "--trace", str(trace_path),
                          "--format", "native", "--policy", "nope"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown policy" in bad.stdout


def test_split_needs_the_store_that_carries_the_kv() -> None:
    # Long uncached prompts split to the prefill worker when the store can carry their KV ...
    cfg = dict(split_threshold_tokens=512)
    yes = simulate_policies(_trace(), _cfg(**cfg), ["round_robin"], jobs=1)["results"]["round_robin"]
    assert yes["split_requests"] > 0
    # ... and never without one: the decode worker would have to compute the prompt again.
    no = simulate_policies(_trace(), _cfg(offload_capacity_tokens=0, **cfg), ["round_robin"], jobs=1)
    assert no["results"]["round_robin"]["split_requests"] == 0
    assert no["results"]["round_robin"]["errors"] == 0


def test_a_split_whose_transfer_the_store_lost_reuses_only_what_its_decode_worker_did_not_compute() -> None:
    """A split's prefill worker writes its KV to the store; a store far smaller than the
    contexts can evict it before the decode worker's restore, which then computes it again.
    The hit rate counts no token either worker computed (kvmesh.routing.split_reuse)."""
    cfg = dict(split_threshold_tokens=512, decode_workers=2, kv_capacity_tokens=12000)
    prompts = {r.uid: r.input_tokens for r in _trace().requests()}
    runs = {store: simulate_policies(_trace(), _cfg(offload_capacity_tokens=store, **cfg), ["round_robin"], jobs=1,
                                     records=True) for store in (15000, 200000)}
    small, big = (runs[s]["results"]["round_robin"] for s in (15000, 200000))
    assert small["split_requests"] > 0 and small["errors"] == 0
    assert small["split_lost_share"] > 0 and big["split_lost_share"] == 0
    recs = runs[15000]["records"]["round_robin"]
    prompt = sum(prompts[r["uid"]] for r in recs)
    splits = [r for r in recs if r["split"]]
    # Per request: a split reused at most what its decode worker found (the transfer included).
    assert all(r["cached_gpu"] + r["cached_offload"] <= r["actual_cached"] for r in splits)
    assert any(r["split_lost"] > 0 for r in splits) and not any(r["split_lost"] for r in recs if not r["split"])
    assert small["split_lost_share"] == round(sum(r["split_lost"] for r in recs) / prompt, 4)
    assert small["prefix_hit_rate"] == round(sum(r["cached_gpu"] + r["cached_offload"] for r in recs) / prompt, 4)


def test_a_sticky_session_splits_only_what_its_worker_lacks() -> None:
    """``session`` predicts nothing; its split reads the index for the worker it chose
    (``SplitConfig.read_index``), so a turn whose context its worker holds stays there."""
    cfg = dict(split_threshold_tokens=512, kv_capacity_tokens=60000)
    run = {ri: simulate_policies(_trace(), _cfg(split_read_index=ri, **cfg), ["session"], jobs=1)["results"]["session"]
           for ri in (True, False)}
    informed, blind = run[True], run[False]
    assert informed["errors"] == blind["errors"] == 0 and informed["requests"] == blind["requests"]
    assert 0 < informed["split_requests"] < blind["split_requests"] / 2
    # A turn kept on the worker that holds its context skips the prefill worker's queue and the
    # transfer back (here the store holds every context, so the hit rate is the same).
    assert informed["ttft_p50_s"] < blind["ttft_p50_s"] and informed["ttft_p90_s"] < blind["ttft_p90_s"]
    assert informed["prefix_hit_rate"] == blind["prefix_hit_rate"]
    # The choice is the policy's either way: sticky, so its turns never move.
    assert informed["moved_requests"] == blind["moved_requests"] == 0
    # The split's survival rule learns from the index's view of the turns kept local, as the
    # live router does: without it, where queues evict contexts before their turns run, the
    # kept turns recompute them (the live-sized cluster of docs/traffic-and-simulation.md).
    from kvmesh_tools.clustersim.run import schedule_for
    from kvmesh_tools.clustersim.sim import ClusterSim

    c = _cfg(**cfg)
    sim = ClusterSim(_trace(), schedule_for(_trace(), c), c, "session")
    sim.run()
    assert sim.core.survival._sums and all(p > 0 for _, p in sim.core.survival._sums.values())


def test_scale_bench_writes_json(tmp_path: Path) -> None:
    from kvmesh_tools.bench.simulate import peak_concurrent_sessions
    from kvmesh_tools.cli.main import main

    recs = [{"uid": "a/main/1", "release_s": 0.0, "ttft_s": 5.0}, {"uid": "b/main/1", "release_s": 1.0, "ttft_s": 1.0},
            {"uid": "a/main/2", "release_s": 9.0, "ttft_s": 1.0}, {"uid": "c/main/1", "release_s": 11.0, "ttft_s": 1.0}]
    assert peak_concurrent_sessions(recs) == 2   # a spans 0..10, b 1..2, c 11..12
    out = tmp_path / "sim.json"
    rc = main(["bench", "simulate", "--json", str(out), "--sessions", "12", "--turns-median", "3",
               "--decode-workers", "16", "--prefill-workers", "2", "--baseline-decode-workers", "4",
               "--baseline-prefill-workers", "1", "--start-window-s", "30", "--policy", "precise,session"])  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    # Every policy on the large cluster, against one ceiling; the capacity says whether the
    # working set fits (--gpu-fit 0.5 by default: the GPUs hold half of it, or the longest request).
    cap = data["capacity"]
    assert cap["kv_capacity_tokens_per_worker"] >= cap["longest_request_tokens"]
    assert cap["gpu_tokens"] == 16 * cap["kv_capacity_tokens_per_worker"]
    assert cap["gpu_fits_working_set"] == (cap["gpu_tokens"] >= cap["working_set_tokens"])
    assert set(data["results"]) == {"precise", "session"} and data["policies"] == ["precise", "session"]
    assert data["cold_first"] and data["split_read_index"]   # the defaults, said in the JSON
    assert 0 < data["ceiling_pooled"] <= data["ceiling_infinite"] <= 1
    for r in data["results"].values():
        assert r["errors"] == 0 and r["requests"] == data["large"]["requests"]
        assert r["share_of_ceiling_pooled"] == round(r["prefix_hit_rate"] / data["ceiling_pooled"], 4)
    assert data["large"]["workers"] == 18 and data["baseline"]["workers"] == 5
    assert data["baseline"]["sessions"] == 3
    for side in ("large", "baseline"):
        assert data[side]["requests"] > 0 and data[side]["errors"] == 0 and data[side]["peak_concurrent_sessions"] >= 1
    assert data["ms_per_request_ratio_vs_baseline"] > 0


def test_scale_bench_runs_the_fleet_once_per_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--regimes``: the same fleet per store size, a size in tokens or a share of the fleet's GPU
    tokens; each regime equals a plain run with that store, and the top level is the first."""
    from kvmesh_tools.cli.main import main

    flags = ["--sessions", "12", "--turns-median", "3", "--decode-workers", "16", "--prefill-workers", "2",
             "--baseline-decode-workers", "4", "--baseline-prefill-workers", "1", "--start-window-s", "30",
             "--policy", "precise,session"]
    assert main(["bench", "simulate", "--json", str(tmp_path / "r.json"), "--regimes", "none,0.25x", *flags]) == 0
    data = json.loads((tmp_path / "r.json").read_text())
    none, quarter = data["regimes"]
    gpu = data["capacity"]["gpu_tokens"]
    assert (none["regime"], none["offload_capacity_tokens"]) == ("none", 0)
    assert (quarter["regime"], quarter["offload_capacity_tokens"]) == ("0.25x", int(0.25 * gpu))
    assert quarter["capacity"]["pooled_tokens"] == gpu + int(0.25 * gpu)
    assert data["results"] == none["results"] and data["ceiling_pooled"] == none["ceiling_pooled"]
    # The prefill workers work only with a store (it carries a split's KV).
    for key in ("offload_blocks_stored", "split_requests"):
        assert quarter["results"]["precise"][key] > 0 == none["results"]["precise"][key], key
    assert main(["bench", "simulate", "--json", str(tmp_path / "p.json"), "--offload-capacity-tokens",
                 str(int(0.25 * gpu)), *flags]) == 0
    plain = json.loads((tmp_path / "p.json").read_text())
    for pol in ("precise", "session"):
        for k in ("prefix_hit_rate", "ttft_p50_s", "ttft_p90_s", "moved_requests", "split_requests",
                  "offload_blocks_stored"):
            assert quarter["results"][pol][k] == plain["results"][pol][k], (pol, k)
    assert quarter["ceiling_pooled"] == plain["ceiling_pooled"]
    out = capsys.readouterr().out
    assert "regime none (no store)" in out and f"regime 0.25x ({int(0.25 * gpu):,}-token store)" in out


@pytest.mark.parametrize(("regimes", "message"), [
    ("none,1y", "'1y' is not a store size"), ("0.1x,0.1x", "named twice"), ("-1x", "between 0x and 1000x"),
    ("abcx", "not a share"), (",", "no regime given")])
def test_scale_bench_refuses_bad_regimes(regimes: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from kvmesh_tools.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "simulate", f"--regimes={regimes}"])
    assert e.value.code == 2 and message in capsys.readouterr().err


class _AlwaysChanged(list):
    """Every worker counts as changed: each poll builds its report from the engine again."""

    def __getitem__(self, i):  # noqa: ANN001, ANN204
        return True


@pytest.mark.parametrize("policy", ["precise", "approx"])
def test_reconfirmed_reports_decide_as_rebuilt_ones(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker whose engine did not change is reconfirmed instead of polled; that must never
    change a decision (a missed change would leave a stale report standing)."""
    from kvmesh_tools.clustersim.run import schedule_for
    from kvmesh_tools.clustersim.sim import ClusterSim

    cfg = _cfg(decode_workers=5, prefill_workers=2, load_poll_s=0.05)
    runs = []
    for rebuild in (False, True):
        tr = _trace(seed=5)
        sim = ClusterSim(tr, schedule_for(tr, cfg), cfg, policy)
        if rebuild:
            sim._changed = _AlwaysChanged(sim._changed)
        res = sim.run()
        runs.append([(r["uid"], r["endpoint"], r["split"], r["cached_gpu"], r["ttft_s"]) for r in res.records])
    assert runs[0] == runs[1] and len(runs[0]) > 50


_TIMES = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "output_tok_per_s", "load_imbalance", "virtual_time_s",
          "decode_busy_s", "prefill_busy_s")


# The small cache's case runs precise without the cluster terms: with them it places contexts
# where they fit and never preempts, and this test is about preempting mid-stretch.
@pytest.mark.parametrize("kw", [dict(), dict(kv_capacity_tokens=14500, scoring=ScoringConfig(cluster_work_weight=0.0,
                                                                                            displace_weight=0.0)),
                                dict(prefill_workers=0, offload_capacity_tokens=0)])
def test_decode_fast_forward_changes_nothing(kw: dict) -> None:
    """Stretches of pure decode run as one event (``macro_steps``, block boundaries included).
    Step by step gives the same decisions, cache hits, preemptions and step counts for every
    request, with caches that evict and requests preempted. Times agree to float rounding: a
    stretch's time is a closed-form sum, step by step adds one step at a time."""
    tr = generate(GeneratorConfig(sessions=8, seed=5, turns_median=6, system_tokens=2048, first_user_tokens=400,
                                  growth_median=300, growth_p99=2000, output_median=150, output_p99=700,
                                  think_median_s=0.5, think_p99_s=5.0, max_context_tokens=14000,
                                  subagent_group_prob=0.3, group_max=6, subagent_system_tokens=1024,
                                  subagent_task_tokens=200, subagent_turns_median=3))
    policies = ["precise", "round_robin"]
    fast = _strip(simulate_policies(tr, _cfg(macro_steps=True, **kw), policies, jobs=1, records=True))
    slow = _strip(simulate_policies(tr, _cfg(macro_steps=False, **kw), policies, jobs=1, records=True))
    assert fast["config"].pop("macro_steps") and not slow["config"].pop("macro_steps")
    # A turn's TTFT is its restore, its wait in the worker's queue and its prefill (records'
    # parts, for checking the router's estimate against the engine model).
    parts = [r for r in fast["records"]["precise"] if "queue_s" in r]
    assert parts and all(r["restore_s"] + r["queue_s"] + r["prefill_s"] == pytest.approx(r["ttft_s"], abs=3e-6)
                         for r in parts)
    assert all("est_wait_s" in r for r in fast["records"]["precise"])
    for p in policies:
        for a, b in zip(fast["records"][p], slow["records"][p], strict=True):
            assert a["release_s"] == pytest.approx(b["release_s"], abs=2e-6)
            for k in ("release_s", "ttft_s", "queue_s", "prefill_s"):
                assert a.pop(k, None) == pytest.approx(b.pop(k, None), abs=2e-6), k
            assert a == b
        fm, sm = fast["results"][p], slow["results"][p]
        for k in _TIMES:
            assert fm.pop(k) == pytest.approx(sm.pop(k), rel=1e-6, abs=2e-4), k
        assert fm == sm
    m = fast["results"]["precise"]
    assert m["steps"] > 0 and m["errors"] == 0 and m["requests"] == len(tr.requests())
    if "kv_capacity_tokens" in kw:
        assert m["preemptions"] > 0


def test_admission_control_holds_recomputes_and_counts_the_wait() -> None:
    """Ten sessions started within 2 s on two workers of 16k tokens: under saturation some
    recomputes find no room and are held at the router (kvmesh.routing.admission). Every
    request is still served, and a held request's TTFT includes its wait at the router."""
    tr = generate(GeneratorConfig(sessions=10, seed=1, turns_median=8, system_tokens=2048, first_user_tokens=400,
                                  growth_median=200, growth_p99=2000, output_median=16, output_p99=64,
                                  think_median_s=1.0, think_p99_s=20.0, max_context_tokens=12000,
                                  subagent_group_prob=0.2, group_max=8, subagent_system_tokens=1024,
                                  subagent_task_tokens=200, subagent_turns_median=3))
    n = len(tr.requests())
    on = _cfg(decode_workers=2, kv_capacity_tokens=16000, offload_capacity_tokens=0, start_window_s=2.0,
              scoring=ScoringConfig(admit_miss_ratio=0.5))
    rep = simulate_policies(tr, on, ["precise"], jobs=1, records=True)
    m = rep["results"]["precise"]
    assert m["requests"] == n and m["errors"] == 0
    assert m["held_requests"] > 0 and m["held_s_total"] > 0
    held = [r for r in rep["records"]["precise"] if r["held_s"] > 0]
    assert len(held) == m["held_requests"]
    assert all(r["ttft_s"] >= r["held_s"] for r in held)
    off = simulate_policies(tr, dataclasses.replace(on, scoring=ScoringConfig()), ["precise"], jobs=1)
    assert off["results"]["precise"]["held_requests"] == 0


class _NoDependents:
    """A schedule runner for hand-made jobs: finishing one releases nothing."""

    def complete(self, idx: int, now: float) -> list:  # noqa: ARG002
        return []


def test_a_restoring_request_keeps_its_place_in_the_queue() -> None:
    """A turn that restores its prefix from the store joins the worker's queue when it is sent
    and keeps its place while its KV loads (vLLM parks it, WAITING_FOR_REMOTE_KVS, and takes it
    once loaded): a request sent after it, which needs no restore but waits for room, is
    scheduled after it."""
    from kvmesh.routing.types import RouteRequest
    from kvmesh_tools.clustersim.run import schedule_for
    from kvmesh_tools.clustersim.sim import HOLD, ClusterSim, Job
    from kvmesh_tools.traffic.model import Request

    tr = _trace()
    bs = tr.block_size
    cfg = _cfg(decode_workers=1, prefill_workers=0, kv_capacity_tokens=20000, offload_capacity_tokens=200000)
    sim = ClusterSim(tr, schedule_for(tr, cfg), cfg, "round_robin")
    sim.runner = _NoDependents()  # type: ignore[assignment]

    def job(name: str, first_id: int, prompt_blocks: int, output: int) -> Job:
        req = Request(uid=f"s-{name}/main/0", session=f"s-{name}", agent="main", t=0.0,
                      input_tokens=prompt_blocks * bs + 8, output_tokens=output,
                      hash_ids=list(range(first_id, first_id + prompt_blocks)), namespace="t", block_size=bs)
        route = RouteRequest(request_id=req.uid, model=cfg.model, keys=req.keys, num_tokens=req.input_tokens,
                             block_size=bs, session_id=f"{req.session}/main")
        return Job(node=0, req=req, route=route, release=0.0)

    # A long turn holds most of the worker's KV while it decodes.
    busy = job("busy", 1_000_000, 12000 // bs, 4000)
    # Its prefix is in the store (an earlier turn saved it): it restores before it is scheduled.
    restoring = job("restoring", 2_000_000, 2000 // bs, 16)
    sim.store.put(restoring.req.keys[:2000 // bs], 0, restoring.req.session)  # type: ignore[union-attr]
    # Sent just after, nothing cached, and too large for the room the busy turn leaves.
    later = job("later", 3_000_000, 9000 // bs, 16)
    for t, j in ((0.0, busy), (5.0, restoring), (5.0, later)):
        j.release = t
        sim._push(t, HOLD, j)
    sim._loop()
    assert all(j.first_token is not None and not j.error for j in (busy, restoring, later))
    assert restoring.planned_restore == 2000 // bs * bs and restoring.restore_delay > 0
    # The restoring turn is served once its KV is in; the later one only when the busy turn ends.
    assert restoring.first_token < later.scheduled  # type: ignore[operator]
    assert later.scheduled >= busy.finish  # type: ignore[operator]
    assert restoring.first_token - restoring.release < 2 * restoring.restore_delay + 1.0


def test_cold_first_warms_every_spare_worker_that_precise_leaves_idle() -> None:
    """More workers than the sessions need: precise's greedy cost packs the sessions onto the
    workers that hold the shared system prompt; ``cold_first`` puts new sessions on the others."""
    used = {}
    for on in (False, True):
        cfg = _cfg(decode_workers=12, offload_capacity_tokens=0, start_window_s=60.0)
        cfg.scoring = dataclasses.replace(cfg.scoring, cold_first=on, cold_after_s=0.0)
        rep = simulate_policies(_trace(), cfg, ["precise"], jobs=1, records=True)
        assert rep["results"]["precise"]["errors"] == 0
        used[on] = {r["endpoint"] for r in rep["records"]["precise"]}
    assert len(used[False]) < 12   # the control: without it some workers never take a request
    assert len(used[True]) == 12


def test_the_table_shows_whole_policy_names_and_the_moved_turns(capsys) -> None:
    """Piped output (CI logs, files) is one table whose header and policy names are whole,
    the moved turns and what they gave up included."""
    from kvmesh_tools.clustersim.report import render_table

    rep = simulate_policies(_trace(), _cfg(offload_capacity_tokens=0), ["precise", "round_robin"], jobs=1)
    render_table(rep)
    out = capsys.readouterr().out
    for text in ("round_robin", "precise", "of pooled", "imbalance", "moved", "gave up", "splits", "split lost",
                 "view bug", "no index"):
        assert text in out, text
    row = next(line for line in out.splitlines() if "round_robin" in line)
    assert str(rep["results"]["round_robin"]["moved_requests"]) in row
