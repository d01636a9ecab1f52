"""kvmesh's Responses conversion equals vLLM's own (``construct_input_messages`` and
``construct_tool_dicts`` in ``vllm/entrypoints/openai/responses/utils.py``): the same prompt through the
same template for the same request, so a router in front of ``vllm serve`` predicts what vLLM renders.
vLLM tier: importing vLLM's serving code takes a while."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvmesh.responses_api.requests import parse_responses
from kvmesh.tokenization import load_tokenizer
from kvmesh.tokenization.chat_render import chat_request_from_body
from tests.libs.responses_api.cases import BODIES

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def _vllm(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.openai.responses.utils import construct_input_messages, construct_tool_dicts

    req = ResponsesRequest(**body)
    msgs = construct_input_messages(request_instructions=req.instructions, request_input=req.input)
    return [dict(m) for m in msgs], construct_tool_dicts(req.tools, req.tool_choice)


@pytest.mark.parametrize("i", range(len(BODIES)))
def test_conversion_renders_as_vllms(i, tiny_model_dir):
    body = {"model": "m", **BODIES[i]}
    ours = parse_responses(json.loads(json.dumps(body)), {}).chat.chat_request
    messages, tools = _vllm(json.loads(json.dumps(body)))
    assert json.dumps(ours.tools) == json.dumps(tools)
    theirs = chat_request_from_body({"messages": messages, "tools": tools})
    # vLLM hands the template the messages it built (a call's function keys name first), not
    # re-parsed ones; the live check of that is test_router_vllm_external.py's Responses test.
    theirs.call_key_order = ("name", "arguments")
    tok = load_tokenizer(tiny_model_dir)
    assert tok.render(ours) == tok.render(theirs)
