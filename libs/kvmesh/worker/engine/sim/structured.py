"""The sim engine's answer to a structured-outputs request: the token ids of a text that matches.

Why it exists: the sim samples pseudo-random token ids, so it cannot decode under a grammar. A
client that asks for a JSON schema (the ``openai`` client's ``parse``, the Agents SDK's
``output_type``) must still get an answer it can parse, or ``kvmesh up`` with sim workers would be
useless to it. So the sim answers such a request with a fixed text built from the constraint: a
value of the schema (``example_value``, as its tool calls' arguments), ``{}`` for a JSON object,
the first choice. It emits that text's token ids under the worker's tokenizer, one per step, then
the tokenizer's EOS: every door decodes it like any answer, and ``max_tokens`` cuts it short as it
would cut a real engine's. A regex or a grammar it cannot follow, or a worker without a tokenizer,
is refused (400) rather than answered with text that does not match.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from kvmesh.structured_outputs import kind
from kvmesh.worker.engine.base import InvalidRequestError
from kvmesh.worker.engine.sim.tool_calls import example_value


def structured_text(spec: dict[str, Any]) -> str:
    """The sim's answer to ``spec`` (``kvmesh.structured_outputs``); raises for what it cannot follow."""
    k = kind(spec)
    if k == "json":
        schema = json.loads(spec["json"]) if isinstance(spec["json"], str) else spec["json"]
        return json.dumps(example_value(schema), separators=(",", ":"))
    if k == "json_object":
        return "{}"
    if k == "choice":
        return spec["choice"][0]
    raise InvalidRequestError(f"the sim engine cannot follow a {k} constraint (a vLLM worker can); "
                              "use json, json_object or choice")


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def scripted_answer(spec: dict[str, Any], tokenizer_path: str) -> tuple[list[int], int]:
    """The token ids of the answer to ``spec`` followed by EOS, and the EOS id."""
    text = structured_text(spec)
    if not tokenizer_path:
        raise InvalidRequestError("the sim engine answers structured outputs with its tokenizer's tokens: start "
                                  "the worker with --tokenizer")
    tok = load_tokenizer(tokenizer_path)
    if tok.eos_token_id is None:
        raise InvalidRequestError("the sim worker's tokenizer has no EOS token to end a structured answer")
    return [*tok.encode(text, add_special_tokens=False), tok.eos_token_id], tok.eos_token_id
