"""Trace readers on small made-up traces of each format."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kvmesh_tools.traffic.model import chain_keys
from kvmesh_tools.traffic.native import write_native
from kvmesh_tools.traffic.readers import TraceFormatError, load_trace
from kvmesh_tools.traffic.schedule import ScheduleOptions, ScheduleRunner, build_schedule
from kvmesh_tools.traffic.tokens import TokenSynthesizer

pytestmark = pytest.mark.timeout(60)


def _cc_session(sid: str) -> dict:
    return {
        "id": sid, "models": ["m"], "block_size": 4, "hash_id_scope": "local", "tool_tokens": 0,
        "system_tokens": 0,
        "requests": [
            {"t": 0.0, "type": "n", "model": "m", "in": 9, "out": 3, "hash_ids": [1, 2],
             "input_types": [], "output_types": [], "stop": "", "api_time": 2.0, "think_time": 0.0},
            {"t": 5.0, "type": "subagent", "agent_id": "agent_001", "subagent_type": "Explore", "duration_ms": 4000,
             "requests": [
                 {"t": 0.0, "type": "n", "model": "h", "in": 8, "out": 2, "hash_ids": [7, 8], "api_time": 1.0},
                 {"t": 3.0, "type": "n", "model": "h", "in": 12, "out": 2, "hash_ids": [7, 8, 9], "api_time": 1.0,
                  "think_time": 2.0},
             ]},
            {"t": 10.0, "type": "n", "model": "m", "in": 13, "out": 3, "hash_ids": [1, 2, 3],
             "api_time": 1.0, "think_time": 1.0},
        ],
    }


def test_claude_code_nested_subagents_and_namespaces(tmp_path: Path) -> None:
    for sid in ("a", "b"):
        with gzip.open(tmp_path / f"{sid}.json.gz", "wt") as fh:
            json.dump(_cc_session(sid), fh)
    tr = load_trace([tmp_path], "weka")
    assert len(tr) == 2 and tr.block_size == 4
    s = tr.sessions[0]
    reqs = s.requests()
    assert [r.agent for r in reqs] == ["main", "agent_001", "agent_001", "main"]
    # sub-agent request times are relative to the sub-agent's t
    assert [r.t for r in reqs] == [0.0, 5.0, 8.0, 10.0]
    assert s.root.sub_agents()[0].duration == 4.0
    # same ids in two files are different blocks (namespaced per session file)
    a, b = tr.sessions[0].requests()[0], tr.sessions[1].requests()[0]
    assert a.hash_ids == b.hash_ids and a.keys != b.keys
    # within a file, equal leading ids give equal chained keys
    assert reqs[0].keys == reqs[3].keys[:2]


def _absolute(doc: dict) -> dict:
    """``doc`` with each sub-agent's request times counted from the session's start, as the
    cc-traces corpora record them."""
    doc = json.loads(json.dumps(doc))
    for it in doc["requests"]:
        if it.get("type") == "subagent":
            for r in it["requests"]:
                r["t"] += it["t"]
    return doc


def _timeline(paths: list[Path]) -> list[tuple]:
    return [(r.uid, r.t, r.keys, r.think_time) for s in load_trace(paths, "weka").sessions
            for r in s.requests()]


def test_a_claude_code_corpus_reads_as_its_files(tmp_path: Path) -> None:
    """A ``.jsonl(.gz)`` corpus (one session per line) gives the sessions, times and block
    keys of the same sessions as files, whichever clock the sub-agents' times use."""
    files = tmp_path / "files"
    files.mkdir()
    for sid in ("a", "b"):
        (files / f"{sid}.json").write_text(json.dumps(_cc_session(sid)))
    with gzip.open(tmp_path / "rel.jsonl.gz", "wt") as fh:
        fh.writelines(json.dumps(_cc_session(sid)) + "\n" for sid in ("a", "b"))
    (tmp_path / "abs.jsonl").write_text("".join(json.dumps(_absolute(_cc_session(sid))) + "\n"
                                                for sid in ("a", "b")))
    want = _timeline([files])
    assert [t for _, t, _, _ in want] == [0.0, 5.0, 8.0, 10.0] * 2
    assert _timeline([tmp_path / "rel.jsonl.gz"]) == want
    assert _timeline([tmp_path / "abs.jsonl"]) == want
    # --limit-sessions reads a corpus's head: a broken line after it is never parsed
    with open(tmp_path / "abs.jsonl", "a") as fh:
        fh.write("{not json\n")
    head = load_trace([tmp_path / "abs.jsonl"], "weka", limit=2)
    assert [s.session_id for s in head.sessions] == ["a", "b"]
    with pytest.raises(TraceFormatError, match=r"abs.jsonl:3: invalid JSON"):
        load_trace([tmp_path / "abs.jsonl"], "weka")


def test_native_sub_agent_times_always_count_from_the_spawn(tmp_path: Path) -> None:
    """Only claude-code sessions may be on the session's clock; a native sub-agent whose first
    request comes after its own ``t`` is still timed from its spawn."""
    line = {"session": "s", "block_size": 4, "requests": [
        {"t": 0.0, "in": 8, "out": 1, "hash_ids": [1, 2]},
        {"type": "subagent", "t": 1.0, "agent_id": "x", "requests": [
            {"t": 2.0, "in": 8, "out": 1, "hash_ids": [3, 4]}]}]}
    (tmp_path / "n.jsonl").write_text(json.dumps(line) + "\n")
    assert [r.t for r in load_trace([tmp_path / "n.jsonl"], "native").sessions[0].requests()] == [0.0, 3.0]


def test_global_hash_ids_are_shared_across_sessions(tmp_path: Path) -> None:
    for sid in ("a", "b"):
        (tmp_path / f"{sid}.json").write_text(json.dumps({**_cc_session(sid), "hash_id_scope": "global"}))
    a, b = (s.requests()[0] for s in load_trace([tmp_path], "weka").sessions)
    assert a.session != b.session and a.keys == b.keys


@pytest.mark.parametrize(("change", "needle"), [
    ({"hash_id_scope": "tenant"}, "hash_id_scope must be 'local' or 'global'"),
    ({"requests": [{"t": -1.0, "type": "n", "in": 4, "out": 1, "hash_ids": [1]}]}, "field 't' must be"),
])
def test_bad_claude_code_session_names_the_line(tmp_path: Path, change: dict, needle: str) -> None:
    path = tmp_path / "corpus.jsonl"
    path.write_text(json.dumps(_cc_session("a")) + "\n" + json.dumps({**_cc_session("b"), **change}) + "\n")
    with pytest.raises(TraceFormatError, match=needle) as err:
        load_trace([path], "weka")
    assert f"{path}:2" in str(err.value)


def test_claude_code_closed_loop_schedule(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps(_cc_session("a")))
    tr = load_trace([tmp_path / "a.json"], "claude-code")
    sch = build_schedule(tr, ScheduleOptions(start_window_s=None))
    run = ScheduleRunner(sch)
    first = run.initial()
    assert first == [(0.0, 0)]
    # the sub-agent launches 3 s after the first call ends (recorded 5.0 - 2.0)
    released = run.complete(0, 100.0)
    assert released == [(103.0, 1)]
    assert run.complete(1, 110.0) == [(112.0, 2)]     # think time 2 s inside the sub-agent
    # the parent's next turn (t=10) waits for the sub-agent, which had ended at t=9 in the recording
    assert run.complete(2, 120.0) == [(121.0, 3)]


def test_a_sub_agent_launched_in_the_background_never_blocks_its_parent(tmp_path: Path) -> None:
    doc = _cc_session("a")
    doc["requests"][1]["status"] = "async_launched"
    (tmp_path / "a.json").write_text(json.dumps(doc))
    tr = load_trace([tmp_path / "a.json"], "weka")
    run = ScheduleRunner(build_schedule(tr, ScheduleOptions(start_window_s=None)))
    assert run.initial() == [(0.0, 0)]
    # the first call's end releases the sub-agent and, with no sub-agent to wait for, the
    # parent's next turn after its think time (1 s)
    assert run.complete(0, 100.0) == [(103.0, 1), (101.0, 3)]
    assert run.complete(1, 110.0) == [(112.0, 2)]
    assert run.complete(2, 120.0) == []
    # written as native and read back, the sub-agent keeps running in the background
    write_native(tr, tmp_path / "a.jsonl")
    back = load_trace([tmp_path / "a.jsonl"], "native").sessions[0]
    assert back.root.sub_agents()[0].detached


def test_mooncake_reader(tmp_path: Path) -> None:
    p = tmp_path / "mc.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 1500, "input_length": 600, "output_length": 7, "hash_ids": [0]},
    ]) + "\n")
    tr = load_trace([p], "mooncake")
    assert tr.block_size == 512 and len(tr) == 2
    r0, r1 = (s.requests()[0] for s in tr.sessions)
    assert tr.sessions[1].start == 1.5
    # ids are global in a mooncake file: block 0 is shared
    assert r0.keys[0] == r1.keys[0]
    sch = build_schedule(tr, ScheduleOptions(start_window_s=None))
    assert sorted(ScheduleRunner(sch).initial()) == [(0.0, 0), (1.5, 1)]


def test_native_roundtrip_and_scope(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps(_cc_session("a")))
    tr = load_trace([tmp_path / "a.json"], "weka")
    out = write_native(tr, tmp_path / "n.jsonl.gz")
    back = load_trace([out], "native")
    r1 = [(r.t, r.input_tokens, r.output_tokens, r.hash_ids, r.agent) for r in tr.requests()]
    r2 = [(r.t, r.input_tokens, r.output_tokens, r.hash_ids, r.agent) for r in back.requests()]
    assert r1 == r2
    lines = [json.dumps({"session": s, "block_size": 4, "hash_id_scope": "global",
                         "requests": [{"t": 0, "in": 8, "out": 1, "hash_ids": [1, 2]}]}) for s in ("x", "y")]
    (tmp_path / "g.jsonl").write_text("\n".join(lines))
    g = load_trace([tmp_path / "g.jsonl"], "native")
    assert g.sessions[0].requests()[0].keys == g.sessions[1].requests()[0].keys


@pytest.mark.parametrize("content,needle", [
    ('{"session": "a", "block_size": 4, "requests": [{"t": 0, "in": 8, "out": 1}]}', "missing field 'hash_ids'"),
    ('{"session": "a", "block_size": 4, "requests": [{"t": 0, "in": "8", "out": 1, "hash_ids": []}]}',
     "field 'in' has type str"),
    ('{"session": "a", "block_size": 0, "requests": []}', "block_size must be positive"),
    ('not json', "invalid JSON"),
    ('{"session": "a", "block_size": 4, "requests": [{"t": 0, "in": 4, "out": 1, "hash_ids": [1, 2, 3]}]}',
     "exceed in=4"),
    *((f'{{"session": "a", "block_size": 4, "requests": [{{"t": 0, "in": 8, "out": 1, "hash_ids": [1, {x}]}}]}}',
       "'hash_ids' must be a list of integers") for x in ("true", '"2"', "2.0", "null", "[2]")),
])
def test_bad_native_input_names_the_problem(tmp_path: Path, content: str, needle: str) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(content + "\n")
    with pytest.raises(TraceFormatError) as ei:
        load_trace([p], "native")
    assert needle in str(ei.value) and "bad.jsonl:1" in str(ei.value)


def test_missing_path_and_unknown_format(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="no such trace"):
        load_trace([tmp_path / "nope.json"], "weka")
    with pytest.raises(TraceFormatError, match="unknown trace format"):
        load_trace([tmp_path], "csv")


def test_tokens_reproduce_prefix_structure_at_any_block_size(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps(_cc_session("a")))
    reqs = load_trace([tmp_path / "a.json"], "weka").requests()
    syn = TokenSynthesizer(vocab_size=300)
    toks = [syn.prompt(r) for r in reqs]
    assert [len(t) for t in toks] == [r.input_tokens for r in reqs]
    assert all(16 <= x < 300 for t in toks for x in t)
    assert toks[0][:8] == toks[3][:8]          # ids [1,2] shared -> 8 tokens shared
    assert toks[1][:8] == toks[2][:8] and toks[1][:4] != toks[0][:4]
    # deterministic across instances
    assert TokenSynthesizer(vocab_size=300).prompt(reqs[3]) == toks[3]
    # equal chained keys <=> equal token blocks, whatever the engine block size
    for bs in (2, 4, 8):
        a, b = toks[0], toks[3]
        n = 0
        while (n + 1) * bs <= min(len(a), len(b)) and a[: (n + 1) * bs] == b[: (n + 1) * bs]:
            n += 1
        assert n * bs >= 8


def test_chain_keys_stable() -> None:
    assert chain_keys("ns", [1, 2, 3]) == chain_keys("ns", [1, 2, 3])
    assert chain_keys("ns", [1, 2])[1] != chain_keys("ns", [9, 2])[1]
