"""``kvmesh up`` serves text out of the box to the official ``openai`` client.

An unmodified external client once got HTTP 400 "this router has no tokenizer" on every chat
request against ``kvmesh up``: the stack now hands the router a tokenizer (the tiny model's by
default), turns /metrics on, and prints the URLs a user needs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("up")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvmesh_tools.cli.main", "up", "--router-port", "0", "--http-port", "0",
         "--decode-workers", "2", "--prefill-workers", "0", "--redis", "off", "--log-dir", str(logs)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "KVMESH_LOG_FORMAT": "text"})
    banner: dict[str, str] = {}
    deadline = time.monotonic() + 180
    assert proc.stdout is not None
    for line in proc.stdout:
        m = re.match(r"\s+(OpenAI base URL|API key|metrics|tokenizer)\s+(\S+)", line)
        if m:
            banner[m.group(1)] = m.group(2)
        if "logs" in banner or len(banner) == 4 or time.monotonic() > deadline:
            break
    try:
        assert len(banner) == 4, f"no banner; kvmesh up printed: {banner}"
        banner["log_dir"] = str(logs)
        yield banner
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


def test_banner_names_the_urls(up) -> None:
    assert up["OpenAI base URL"].startswith("http://127.0.0.1:") and up["OpenAI base URL"].endswith("/v1")


def test_metrics_need_the_stack_token_by_default(up) -> None:
    """The default stack's /metrics refuses a scrape without the token (or with another one)
    and serves the one that sends the token from <log_dir>/auth/metrics-token."""
    for headers in ({}, {"Authorization": "Bearer not-the-token"}):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(up["metrics"], headers=headers), timeout=10)
        assert err.value.code == 401
    token = (Path(up["log_dir"]) / "auth" / "metrics-token").read_text().strip()
    req = urllib.request.Request(up["metrics"], headers={"Authorization": f"Bearer {token}"})
    assert "kvmesh_router" in urllib.request.urlopen(req, timeout=10).read().decode()


def test_keys_are_on_by_default(up) -> None:
    """The banner's key is the stack's key (also in <log_dir>/auth/api-key); any other is refused."""
    assert up["API key"].startswith("kvm-")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=up["OpenAI base URL"], api_key="unused", max_retries=0).models.list()


def test_replay_over_the_stacks_mutual_tls_writes_its_report_without_the_key(up, tmp_path: Path) -> None:
    """``kvmesh replay`` against the default stack (mutual TLS on gRPC) once ran to the end and then
    failed writing its report (the TLS settings were not JSON), and a report without TLS held the
    API key in plain text."""
    stack = json.loads((Path(up["log_dir"]) / "stack.json").read_text())
    out = tmp_path / "replay.json"
    run = subprocess.run(
        [sys.executable, "-m", "kvmesh_tools.cli.main", "replay", "--generate-sessions", "2",
         "--target", stack["router_grpc"], "--tls", "on", "--tls-ca", stack["tls"]["ca"],
         "--tls-cert", stack["tls"]["admin_cert"], "--tls-key", stack["tls"]["admin_key"],
         "--api-key", up["API key"], "--time-scale", "50", "--max-output-tokens", "4", "--progress", "false",
         "--json", str(out)], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    text = out.read_text()
    report = json.loads(text)
    assert report["metrics"]["ok"] > 0 and report["metrics"]["errors"] == 0
    assert report["config"]["tls"]["tls"] == "on" and report["config"]["api_key"] == "(set)"
    assert up["API key"] not in text


def test_replay_with_a_wrong_key_says_so_without_a_traceback(up, tmp_path: Path) -> None:
    stack = json.loads((Path(up["log_dir"]) / "stack.json").read_text())
    grpc_args = ["--target", stack["router_grpc"], "--tls", "on", "--tls-ca", stack["tls"]["ca"],
                 "--tls-cert", stack["tls"]["admin_cert"], "--tls-key", stack["tls"]["admin_key"]]
    http_args = ["--api", "http", "--target", up["OpenAI base URL"].removesuffix("/v1")]
    for args, says in ((grpc_args, "UNAUTHENTICATED"), (http_args, "401")):
        run = subprocess.run(
            [sys.executable, "-m", "kvmesh_tools.cli.main", "replay", "--generate-sessions", "1", *args,
             "--api-key", "not-the-key", "--progress", "false", "--json", str(tmp_path / "r.json")],
            capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and says in run.stdout and "Traceback" not in run.stderr + run.stdout, (
            run.stdout[-1000:] + run.stderr[-1000:])
        assert not (tmp_path / "r.json").exists()


def test_official_openai_client_chats_in_text(up) -> None:
    client = openai.OpenAI(base_url=up["OpenAI base URL"], api_key=up["API key"], max_retries=0)
    models = client.models.list()
    model = models.data[0].id
    resp = client.chat.completions.create(model=model, max_tokens=8,
                                          messages=[{"role": "system", "content": "You are terse."},
                                                    {"role": "user", "content": "Say hello."}])
    assert resp.choices[0].message.role == "assistant" and isinstance(resp.choices[0].message.content, str)
    assert resp.usage is not None and resp.usage.prompt_tokens > 5 and 0 < resp.usage.completion_tokens <= 8
    done = client.completions.create(model=model, prompt="def main():", max_tokens=4)
    assert done.usage is not None and done.usage.completion_tokens <= 4


def test_a_request_without_max_tokens_gets_an_answer_that_ends(up) -> None:
    """Most clients name no max_tokens (the banner's curl, LangChain, an agent's tool loop). vLLM then
    allows the rest of max_model_len, which a dummy model fills: the 262k-token answer took the
    banner's own curl past any timeout. The stack's sim workers end an answer as a model does."""
    client = openai.OpenAI(base_url=up["OpenAI base URL"], api_key=up["API key"], max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    resp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}])
    assert resp.choices[0].finish_reason == "stop" and resp.usage is not None
    assert 128 < resp.usage.completion_tokens <= 384   # 256 (--answer-tokens) +- half
    tool = {"type": "function", "function": {"name": "read", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
    called = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Read a.py."}],
                                            tools=[tool], tool_choice="required")
    assert called.choices[0].finish_reason == "tool_calls" and called.choices[0].message.tool_calls


def test_an_agents_tool_loop_ends(up) -> None:
    """With tool_choice auto the sim workers call the offered tools on about 3 answers in 4 (drawn per
    request), so an agent that loops until a text answer (Claude Code, Codex, the Agents SDK) stops."""
    client = openai.OpenAI(base_url=up["OpenAI base URL"], api_key=up["API key"], max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    tool = {"type": "function", "function": {"name": "read", "parameters": {"type": "object", "properties": {}}}}
    messages: list[dict] = [{"role": "user", "content": "Fix the bug."}]
    for turn in range(40):
        r = client.chat.completions.create(model=model, messages=messages, tools=[tool], max_tokens=16)
        msg = r.choices[0].message
        if not msg.tool_calls:
            assert r.choices[0].finish_reason == "length" and turn < 40
            return
        messages += [msg.model_dump(exclude_none=True),
                     *({"role": "tool", "tool_call_id": c.id, "content": "ok"} for c in msg.tool_calls)]
    pytest.fail("40 tool calls in a row: the loop never ended")


class Finding(BaseModel):
    file: str
    line: int
    severity: Literal["low", "high"]


def test_parse_helpers_get_their_schema_out_of_the_box(up) -> None:
    """Structured outputs through ``kvmesh up``: the sim workers write a matching answer in the stack
    tokenizer's tokens, so the ``openai`` client's ``parse`` helpers work against the stack."""
    client = openai.OpenAI(base_url=up["OpenAI base URL"], api_key=up["API key"], max_retries=0)
    model = client.models.list().data[0].id
    r = client.chat.completions.parse(model=model, max_tokens=64, response_format=Finding,
                                      messages=[{"role": "user", "content": "Review utils.py."}])
    assert isinstance(r.choices[0].message.parsed, Finding)
    assert isinstance(client.responses.parse(model=model, input="Review it.", text_format=Finding,
                                             max_output_tokens=64).output_parsed, Finding)


def test_the_store_registers_a_replay_socket(up) -> None:
    """An indexer that lost the store's event batches (a Redis timeout) replays them; without a
    replay socket it cleared the store's blocks from the index, and restores went unpredicted."""
    log = Path(up["log_dir"]) / "indexer.log"
    deadline = time.monotonic() + 60
    line = ""
    while time.monotonic() < deadline and not line:
        line = next((ln for ln in log.read_text().splitlines()
                     if "subscribed to kv events" in ln and "endpoint=offload-0" in ln), "")
        time.sleep(0.2)
    assert re.search(r"replay=tcp://127\.0\.0\.1:\d+", line), line


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie stays until the machine's init reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_repeated_stop_signals_still_stop_every_service(tmp_path: Path) -> None:
    """An orchestrator (or a user pressing Ctrl-C again) may signal ``kvmesh up`` more than once. A second
    signal used to interrupt the shutdown itself and leave the services running, orphaned."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvmesh_tools.cli.main", "up", "--router-port", "0", "--http-port", "0",
         "--decode-workers", "1", "--prefill-workers", "0", "--redis", "off", "--auth", "off",
         "--log-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "KVMESH_LOG_FORMAT": "text"})
    pids: dict[str, int] = {}
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "OpenAI base URL" in line:
                break
        pids = json.loads((tmp_path / "stack.json").read_text())["pids"]
        assert pids and all(_running(p) for p in pids.values())
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGTERM, signal.SIGTERM):
            proc.send_signal(sig)
            time.sleep(0.3)
        proc.wait(60)
        deadline = time.monotonic() + 10
        while any(_running(p) for p in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [name for name, p in pids.items() if _running(p)]
    finally:
        for pid in [proc.pid, *pids.values()]:   # each service runs in a process group of its own
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(10)
