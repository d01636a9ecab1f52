"""Contract: kvmesh's chat renderer gives exactly the prompt token ids vLLM 0.32's OpenAI server gives.

vLLM's own online renderer (the code behind ``/v1/chat/completions``) runs in-process on the tiny
model directory, with the tiny model's chat template and with a real tool-capable template
(``tests/data/chat_templates/qwen2_5.jinja``), over many varied requests (``tests/helpers/chat_cases``).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from kvmesh.tokenization.chat_render import ChatRenderer, chat_request_from_body
from kvmesh.tokenization.content_format import detect_content_format
from tests.helpers.chat_cases import make_case

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

N_CASES = 60
QWEN = Path(__file__).parents[2] / "data" / "chat_templates" / "qwen2_5.jinja"
TEMPLATES = {"tiny": (None, {"add_generation_prompt": [False, True]}),
             "qwen2_5": (QWEN, {"enable_thinking": [False, True]})}


class VllmChat:
    """vLLM's ``OnlineRenderer`` for one chat template (as ``vllm serve --chat-template``)."""

    def __init__(self, model_dir: Path, template: str | None) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from vllm.config import ModelConfig, VllmConfig
        from vllm.renderers.online_renderer import OnlineRenderer
        from vllm.renderers.registry import renderer_from_config

        mc = ModelConfig(model=str(model_dir), max_model_len=4096)
        self.renderer = renderer_from_config(VllmConfig(model_config=mc))
        self.online = OnlineRenderer(mc, self.renderer, request_logger=None, chat_template=template,
                                     chat_template_content_format="auto", enable_auto_tools=True,
                                     tool_parser="hermes")

    def ids(self, body: dict[str, Any]) -> list[int]:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        res = asyncio.run(self.online.render_chat(ChatCompletionRequest(**body)))
        assert isinstance(res, tuple), f"vLLM refused the request: {res}"
        return list(res[1][0]["prompt_token_ids"])


@pytest.fixture(scope="module")
def vllm_chat(tiny_model_dir: Path) -> dict[str, VllmChat]:
    return {name: VllmChat(tiny_model_dir, path.read_text() if path else None)
            for name, (path, _) in TEMPLATES.items()}


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("side", ["router", "worker"])
def test_ids_equal_vllm(name: str, side: str, vllm_chat: dict[str, VllmChat], tiny_model_dir: Path) -> None:
    """The router's renderer (template source + fast tokenizer) and the worker's (a transformers
    tokenizer) both give vLLM's ids."""
    from transformers import AutoTokenizer

    path, kwargs = TEMPLATES[name]
    tpl = path.read_text() if path else None
    hf = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    ours = ChatRenderer(tiny_model_dir, chat_template=tpl) if side == "router" else \
        ChatRenderer(hf_tokenizer=hf, chat_template=tpl)
    cases = [make_case(i, kwargs_keys=kwargs) for i in range(N_CASES)]
    assert sum(1 for c in cases if c.get("tools")) >= 20
    assert sum(1 for c in cases if any(m["role"] == "tool" for m in c["messages"])) >= 10
    assert sum(1 for c in cases if c.get("chat_template_kwargs")) >= 10
    diffs = []
    for i, body in enumerate(cases):
        want = vllm_chat[name].ids(body)
        got = ours.render_ids(chat_request_from_body(body))
        if got != want:
            diffs.append((i, hf.decode(got)[-300:], hf.decode(want)[-300:]))
    assert not diffs, f"{len(diffs)} of {N_CASES} differ; first: {diffs[0]}"


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_content_format_detection_equals_vllm(name: str, tiny_model_dir: Path) -> None:
    from vllm.renderers.hf import _detect_content_format

    from kvmesh.tokenization.tiny_model import CHAT_TEMPLATE

    path, _ = TEMPLATES[name]
    text = path.read_text() if path else CHAT_TEMPLATE
    assert detect_content_format(text) == _detect_content_format(text, default="string")
