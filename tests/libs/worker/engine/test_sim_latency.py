"""Latency model and scheduler behaviour of the sim engine (pure, synchronous cores)."""

from __future__ import annotations

import pytest

from kvmesh.worker.engine.sim.block_manager import BlockManager, Removed
from kvmesh.worker.engine.sim.latency import LatencyModel, LatencyParams, PrefillChunk
from kvmesh.worker.engine.sim.scheduler import Scheduler, SchedulerConfig, Seq

pytestmark = pytest.mark.timeout(30)


def test_prefill_cost_grows_with_uncached_tokens_and_context() -> None:
    m = LatencyModel()
    assert m.prefill_cost(2000, 0) > m.prefill_cost(1000, 0) > 0
    # Same new tokens, longer context: attention makes it dearer.
    assert m.prefill_cost(1000, 100_000) > m.prefill_cost(1000, 0)
    # Attention is quadratic: doubling a long prompt more than doubles its cost.
    assert m.prefill_cost(100_000, 0) > 2 * m.prefill_cost(50_000, 0)
    p = m.p
    exact = 1000 * p.prefill_s_per_token + 1000 * (5000 + 500) * p.attn_s_per_token_pair
    assert m.prefill_cost(1000, 5000) == pytest.approx(exact)


def test_cached_prefix_cuts_ttft() -> None:
    m = LatencyModel()
    cold = m.estimate_ttft(100_000, 0)
    warm = m.estimate_ttft(100_000, 96_000)
    assert warm < cold / 10
    # The defaults follow llm-d's H100 profile: 30 ms overhead + 250 us per token (+ attention).
    assert m.estimate_ttft(1, 0) == pytest.approx(0.030 + 0.004 + 250e-6, rel=0.01)


def test_step_time_decode_and_mixed() -> None:
    m = LatencyModel()
    assert m.step_time([], []) == 0.0
    one = m.step_time([], [1000])
    assert one == pytest.approx(m.p.step_overhead_s + m.p.itl_s + m.p.decode_s_per_seq
                                + 1000 * m.p.decode_s_per_ctx_token)
    assert m.step_time([], [100_000]) > one                  # KV reads grow with context
    assert m.step_time([], [1000] * 32) > one                # and with batch size
    mixed = m.step_time([PrefillChunk(2048, 0)], [1000])
    assert mixed > m.step_time([PrefillChunk(2048, 0)], []) and mixed > one


def test_restore_time_is_measured_plus_modelled_h2d() -> None:
    m = LatencyModel(LatencyParams(h2d_bytes_per_s=1e9, restore_overhead_s=0.001))
    assert m.restore_time(0, 0.5) == 0.5
    assert m.restore_time(10**9, 0.25) == pytest.approx(0.25 + 0.001 + 1.0)


def test_bad_params_rejected() -> None:
    with pytest.raises(ValueError, match="itl_s"):
        LatencyModel(LatencyParams(itl_s=-1))


def _sched(num_blocks=64, bs=16, budget=64, max_seqs=8) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, bs), LatencyModel(),
                     SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget))


def _seq(rid: str, n: int, keys: list[int] | None = None, max_tokens: int = 4) -> Seq:
    return Seq(request_id=rid, prompt_len=n, max_tokens=max_tokens,
               block_hashes=list(keys) if keys is not None else [hash((rid, i)) & (2**64 - 1) for i in range(n // 16)])


def test_chunked_prefill_shares_steps_with_decode() -> None:
    s = _sched(budget=64)
    s.add(_seq("short", 10, max_tokens=10))
    p = s.plan()
    s.complete(p)                                  # short: prefilled, 1 token out
    s.add(_seq("long", 200))
    p = s.plan()
    work = {q.request_id: n for q, n in p.scheduled}
    assert work == {"short": 1, "long": 63}        # decode first, the rest of the budget prefills
    assert p.num_decode_seqs == 1 and p.num_prefill_tokens == 63
    s.complete(p)
    steps = 1
    while s.get("long") and s.get("long").num_output == 0:
        s.complete(s.plan())
        steps += 1
    assert steps == 4                              # 200 tokens at <= 63..64 per step


def test_prefix_hit_skips_compute_and_counts() -> None:
    s = _sched()
    keys = list(range(1, 7))
    s.add(_seq("a", 100, keys, max_tokens=1))
    while s.has_work:
        s.complete(s.plan())
    b = _seq("b", 100, keys, max_tokens=1)
    s.add(b)
    p = s.plan()
    assert b.num_cached_tokens == 96 and p.scheduled[0][1] == 4
    assert s.blocks.hits_tokens == 96 and s.blocks.queries_tokens == 200


def test_max_num_seqs_and_waiting_prefill_tokens() -> None:
    s = _sched(max_seqs=2, budget=1000)
    for i in range(4):
        s.add(_seq(f"r{i}", 32))
    assert s.waiting_prefill_tokens() == 128
    s.plan()
    assert s.num_running == 2 and s.num_waiting == 2


def test_preemption_when_blocks_run_out_then_recovery() -> None:
    s = _sched(num_blocks=9, bs=16, budget=1000)     # 8 usable blocks
    s.add(_seq("a", 60, max_tokens=40))
    s.add(_seq("b", 60, max_tokens=40))
    finished = []
    for _ in range(400):
        if not s.has_work:
            break
        p = s.plan()
        finished += [q.request_id for q in s.complete(p).finished]
    assert sorted(finished) == ["a", "b"]
    assert s.num_preemptions >= 1
    assert s.blocks.num_free_blocks == 8


def test_abort_frees_blocks_and_emits_nothing_removed() -> None:
    s = _sched()
    s.add(_seq("a", 64))
    s.complete(s.plan())
    assert s.blocks.num_free_blocks < 63
    s.abort("a")
    assert s.blocks.num_free_blocks == 63
    assert not [e for e in s.blocks.take_events() if isinstance(e, Removed)]


def test_waiting_prefill_counts_a_queued_siblings_prefix_once() -> None:
    s = _sched(budget=64)
    shared = list(range(1, 7))                     # 6 blocks = 96 tokens of shared prefix
    s.add(_seq("first", 100, shared, max_tokens=1))
    # A sibling arriving while the first still queues: nothing is cached yet, but the first
    # computes the shared blocks before the sibling is scheduled (FCFS), so only its tail counts.
    s.add(_seq("sib", 130, shared + [70, 71], max_tokens=1))
    assert s.waiting_prefill_tokens() == 100 + (130 - 96)
    # An unrelated prompt counts in full.
    s.add(_seq("other", 50, [900, 901, 902], max_tokens=1))
    assert s.waiting_prefill_tokens() == 100 + 34 + 50
    while s.has_work:
        s.complete(s.plan())
    assert s.get("sib") is None and s.waiting_prefill_tokens() == 0


def test_a_request_held_back_by_ready_keeps_its_place_and_others_run() -> None:
    """The ``ready`` check (KV loading from the store) holds one request; the next runs; once
    ready, the held one is scheduled with what was loaded counted as cached."""
    s = _sched(budget=1000)
    loading = {"a"}
    asked: list[tuple[str, int]] = []

    def ready(seq: Seq, gpu_blocks: int) -> bool:
        asked.append((seq.request_id, gpu_blocks))
        return seq.request_id not in loading

    s.ready = ready
    a, b = _seq("a", 64, max_tokens=2), _seq("b", 32, max_tokens=2)
    s.add(a)
    s.add(b)
    p = s.plan()
    assert [q.request_id for q, _ in p.scheduled] == ["b"]
    assert [q.request_id for q in s.waiting] == ["a"] and a.num_cached_tokens < 0
    s.complete(p)
    loading.clear()
    a.external_cached = 48                         # what the load brought: 3 blocks
    p = s.plan()
    assert ("a", 0) in asked
    assert dict((q.request_id, n) for q, n in p.scheduled)["a"] == 16
    assert a.num_cached_tokens == 48 and a.num_cached_gpu == 0
