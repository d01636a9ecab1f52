"""Every front door tokenizes an agent's next turn incrementally, with the ids of a full tokenization.

A real router (tiny model tokenizer and template, ``--tokenize-verify full``: every incremental result
is checked against a full tokenization) and a sim worker. For each front door (OpenAI chat over HTTP,
Anthropic Messages, gRPC chat) a long conversation is sent, then the same conversation with a new
turn appended: the second turn is a cache ``hit`` (only the appended part tokenized), verified equal
to a full tokenization, and its prompt has the length of the local full rendering. A turn that edits
the middle of the conversation is tokenized in full and counted as ``edit``.
"""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import grpc
import httpx
import openai
import pytest

from kvmesh.tokenization import load_tokenizer
from kvmesh_api.common.v1 import common_pb2
from kvmesh_api.router.v1 import router_pb2, router_pb2_grpc
from kvmesh_tools.testing.ports import free_port
from kvmesh_tools.testing.procs import ServiceProcess
from tests.fixtures.router import BLOCK, MODEL, start_worker

pytestmark = pytest.mark.timeout(240)


class Router:
    def __init__(self, proc: ServiceProcess) -> None:
        self.proc = proc
        self.http = f"http://127.0.0.1:{proc.args[proc.args.index('--http-port') + 1]}"
        self.metrics = f"http://127.0.0.1:{proc.args[proc.args.index('--metrics-port') + 1]}/metrics"

    def outcomes(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for line in httpx.get(self.metrics, timeout=10).text.splitlines():
            if line.startswith("kvmesh_router_tokenize_cache_total{"):
                outcome = line.split('outcome="')[1].split('"')[0]
                out[outcome] = float(line.rsplit(" ", 1)[1])
        return out


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir) -> Iterator[Router]:
    tmp = tmp_path_factory.mktemp("router-incremental")
    w = start_worker(tmp, "w1")
    proc = None
    try:
        def ports() -> tuple[list[str], str]:
            port = free_port()
            return ["--host", "127.0.0.1", "--port", str(port), "--http-port", str(free_port()),
                    "--metrics-port", str(free_port()), "--model", MODEL, "--block-size", str(BLOCK),
                    "--endpoints", f"w1={w.grpc_address}", "--tokenizer-path", str(tiny_model_dir),
                    "--tokenize-verify", "full", "--auth", "off", "--grace-s", "1"], f"127.0.0.1:{port}"

        proc = ServiceProcess.on_fresh_ports("router", ports, log_path=tmp / "router.log").start(60)
        yield Router(proc)
    finally:
        if proc is not None:
            proc.stop(grace_s=3)
        w.stop(grace_s=3)


def _conversation(tag: str) -> list[dict]:
    """An agent conversation of ~30k characters (above the incremental threshold)."""
    msgs = [{"role": "system", "content": f"You are coding agent {tag}. " + "Follow the repository rules. " * 40}]
    for i in range(24):
        msgs.append({"role": "user", "content": f"Step {i}: read src/mod_{i}.py\n" + f"def f{i}(x):\n    return x + {i}\n" * 30})
        msgs.append({"role": "assistant", "content": f"Done with step {i}; the function adds {i}."})
    msgs.append({"role": "user", "content": "Now run the tests."})
    return msgs


def _next_turn(msgs: list[dict]) -> list[dict]:
    return msgs + [{"role": "assistant", "content": "All 24 tests pass."},
                   {"role": "user", "content": "Good. Refactor f3 and f7 into one helper.\n" + "    y = 1\n" * 20}]


def _rendered_len(tiny_model_dir, msgs: list[dict]) -> int:
    return len(load_tokenizer(tiny_model_dir).apply_chat_template(msgs, add_generation_prompt=True))


def _chat(router: Router, msgs: list[dict], session: str) -> int:
    client = openai.OpenAI(base_url=router.http + "/v1", api_key="k", max_retries=0, timeout=60)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, extra_headers={"x-session-id": session})
    return r.usage.prompt_tokens


def _messages(router: Router, msgs: list[dict], session: str) -> int:
    client = anthropic.Anthropic(base_url=router.http, api_key="k", max_retries=0, timeout=60)
    system, rest = msgs[0]["content"], msgs[1:]
    m = client.messages.create(model=MODEL, max_tokens=2, system=system, messages=rest,
                               metadata={"user_id": session})
    return m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)


def _grpc(router: Router, msgs: list[dict], session: str) -> int:
    with grpc.insecure_channel(router.proc.grpc_address) as ch:
        req = router_pb2.GenerateRequest(
            model=MODEL, session_id=session, sampling=common_pb2.SamplingParams(max_tokens=2),
            chat=router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role=m["role"], content=m["content"])
                                                   for m in msgs], add_generation_prompt=True))
        [final] = [m.final for m in router_pb2_grpc.RouterStub(ch).Generate(req, timeout=60) if m.HasField("final")]
    return final.usage.prompt_tokens


DOORS = {"chat": _chat, "messages": _messages, "grpc": _grpc}


@pytest.mark.parametrize("door", sorted(DOORS))
def test_the_next_turn_is_tokenized_incrementally_with_full_ids(router, tiny_model_dir, door) -> None:
    send = DOORS[door]
    turn1 = _conversation(door)
    assert send(router, turn1, f"s-{door}") == _rendered_len(tiny_model_dir, turn1)
    before = router.outcomes()
    turn2 = _next_turn(turn1)
    assert send(router, turn2, f"s-{door}") == _rendered_len(tiny_model_dir, turn2)
    after = router.outcomes()
    assert after.get("hit", 0) - before.get("hit", 0) == 1
    assert after.get("verified", 0) - before.get("verified", 0) == 1     # checked against a full tokenization
    assert after.get("mismatch", 0) == 0


def test_a_mid_conversation_edit_falls_back_to_full_tokenization(router, tiny_model_dir) -> None:
    turn1 = _conversation("edit")
    _chat(router, turn1, "s-edit")
    edited = [dict(m) for m in _next_turn(turn1)]
    edited[5]["content"] = edited[5]["content"].replace("return x + 2", "return x * 2")
    before = router.outcomes()
    assert _chat(router, edited, "s-edit") == _rendered_len(tiny_model_dir, edited)
    after = router.outcomes()
    assert after.get("edit", 0) - before.get("edit", 0) == 1
    assert after.get("hit", 0) == before.get("hit", 0)


def test_the_decision_reports_its_parts(router) -> None:
    """``kvmesh`` in the answer splits the decision: render + tokenize, hashing and the index lookup are
    parts of it (disjoint, so they add up to no more than it); with no indexer there is no lookup."""
    client = openai.OpenAI(base_url=router.http + "/v1", api_key="k", max_retries=0, timeout=60)
    r = client.chat.completions.create(model=MODEL, messages=_conversation("parts"), max_tokens=2)
    k = r.model_extra["kvmesh"]
    assert k["tokenize_ms"] > 0 and k["hash_ms"] > 0 and k["lookup_ms"] == 0
    assert k["tokenize_ms"] + k["hash_ms"] + k["lookup_ms"] <= k["decision_ms"]
