"""One structured-outputs spec from every door: vLLM's folding of ``response_format`` into
``structured_outputs`` and its one-constraint rules (``kvmesh.structured_outputs``), and the sim's
matching answers (``kvmesh.worker.engine.sim.structured``)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvmesh import structured_outputs as so
from kvmesh.anthropic.errors import AnthropicError
from kvmesh.anthropic.requests import parse_messages
from kvmesh.openai.errors import BadRequest
from kvmesh.openai.requests import parse_chat, parse_completion
from kvmesh.responses_api.requests import parse_responses
from kvmesh.worker.engine.base import InvalidRequestError
from kvmesh.worker.engine.sim.structured import scripted_answer, structured_text

SCHEMA = {"type": "object", "properties": {"file": {"type": "string"}, "line": {"type": "integer", "minimum": 3}},
          "required": ["file", "line"], "additionalProperties": False}
MSGS = [{"role": "user", "content": "hi"}]


def test_response_format_folds_into_the_spec_as_vllm_does() -> None:
    assert so.from_openai({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}, None) == \
        {"json": SCHEMA}
    assert so.from_openai({"type": "json_object"}, None) == {"json_object": True}
    assert so.from_openai({"type": "text"}, None) is None and so.from_openai(None, None) is None
    # response_format replaces the constraint and keeps structured_outputs' options.
    assert so.from_openai({"type": "json_object"}, {"disable_any_whitespace": True}) == \
        {"json_object": True, "disable_any_whitespace": True}
    # OpenAI's schema is optional: any JSON, as vLLM reads a missing one.
    assert so.from_openai({"type": "json_schema", "json_schema": {"name": "x"}}, None) == {"json": {}}
    assert so.from_openai(None, {"regex": "[a-z]+", "json_object": False}) == {"regex": "[a-z]+"}
    assert so.from_openai(None, {"choice": ["a", "b"]}, tool_choice="auto") == {"choice": ["a", "b"]}


@pytest.mark.parametrize(("rf", "spec", "tool_choice", "param", "words"), [
    ({"type": "xml"}, None, None, "response_format", "must be one of"),
    ("json", None, None, "response_format", "must be one of"),
    ({"type": "json_schema", "json_schema": {"schema": []}}, None, None, "response_format", "'schema' object"),
    ({"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}, None, None, "response_format", "name"),
    (None, [], None, "structured_outputs", "JSON object"),
    (None, {"regex": "a", "choice": ["a"]}, None, "structured_outputs", "exactly one constraint"),
    (None, {"whitespace_pattern": " "}, None, "structured_outputs", "got none"),
    (None, {"json": "not json"}, None, "structured_outputs", "JSON schema"),
    (None, {"json": [1]}, None, "structured_outputs", "JSON schema"),
    (None, {"regex": ""}, None, "structured_outputs", "non-empty"),
    (None, {"choice": ["a", 1]}, None, "structured_outputs", "strings"),
    (None, {"choice": ["a"] * (so.MAX_CHOICES + 1)}, None, "structured_outputs", "strings"),
    (None, {"json_object": "yes"}, None, "structured_outputs", "must be true"),
    (None, {"grammar": "root ::= 'a'", "disable_any_whitespace": "no"}, None, "structured_outputs", "boolean"),
    (None, {"structural_tag": "{}"}, None, "structured_outputs", "not supported"),
    (None, {"_backend": "outlines", "json_object": True}, None, "structured_outputs", "unknown field '_backend'"),
    (None, {"json": {}}, {"type": "function", "function": {"name": "f"}}, "structured_outputs", "not both"),
    ({"type": "json_object"}, {"regex": "a"}, None, "structured_outputs", "exactly one constraint"),
])
def test_bad_specs_name_their_field(rf, spec, tool_choice, param, words) -> None:
    with pytest.raises(so.StructuredOutputsError) as err:
        so.from_openai(rf, spec, tool_choice)
    assert err.value.param == param and words in err.value.message, err.value.message


def test_the_wire_form_is_checked_again() -> None:
    spec = {"json": SCHEMA, "disable_additional_properties": True}
    assert so.from_json(so.to_json(spec)) == spec and so.to_json(None) == "" and so.from_json("") is None
    for bad in ("{", "[]", '{"regex": "a", "grammar": "b"}', '{"choice": "ab"}'):
        with pytest.raises(so.StructuredOutputsError):
            so.from_json(bad)


def test_every_door_produces_the_same_spec() -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "loc", "schema": SCHEMA}}
    chat = parse_chat({"model": "m", "messages": MSGS, "response_format": rf}, {})
    completion = parse_completion({"model": "m", "prompt": "x", "response_format": rf}, {})
    responses = parse_responses({"model": "m", "input": "hi", "text": {"format": {
        "type": "json_schema", "name": "loc", "schema": SCHEMA, "strict": True}}}, {})
    messages = parse_messages({"model": "m", "max_tokens": 8, "messages": MSGS, "output_config": {
        "format": {"type": "json_schema", "schema": SCHEMA}}}, {})
    assert chat.structured_outputs == completion.structured_outputs == responses.chat.structured_outputs == \
        messages.structured_outputs == {"json": SCHEMA}
    vllm_ext = parse_responses({"model": "m", "input": "hi", "structured_outputs": {"choice": ["a"]}}, {})
    assert vllm_ext.chat.structured_outputs == {"choice": ["a"]}
    with pytest.raises(BadRequest) as err:   # vLLM: "Cannot specify both structured_outputs and text.format"
        parse_responses({"model": "m", "input": "hi", "text": {"format": {"type": "json_object"}},
                         "structured_outputs": {"choice": ["a"]}}, {})
    assert err.value.param == "structured_outputs"
    with pytest.raises(BadRequest) as err:
        parse_chat({"model": "m", "messages": MSGS, "guided_json": SCHEMA}, {})
    assert err.value.param == "guided_json" and "structured_outputs" in err.value.message
    with pytest.raises(AnthropicError) as aerr:
        parse_messages({"model": "m", "max_tokens": 8, "messages": MSGS, "output_format": {
            "type": "json_schema", "schema": SCHEMA}}, {})
    assert "output_config.format" in aerr.value.message


def test_the_sims_answer_matches_the_constraint(tiny_model_dir) -> None:
    nested = {"$defs": {"Step": SCHEMA}, "type": "object", "required": ["steps", "ok"], "properties": {
        "steps": {"type": "array", "items": {"$ref": "#/$defs/Step"}, "minItems": 2}, "ok": {"type": "boolean"}}}
    for schema in (SCHEMA, nested, json.dumps(SCHEMA)):
        text = structured_text({"json": schema})
        jsonschema.validate(json.loads(text), json.loads(schema) if isinstance(schema, str) else schema)
    assert structured_text({"json_object": True}) == "{}"
    assert structured_text({"choice": ["left", "right"]}) == "left"
    for spec in ({"regex": "a+"}, {"grammar": "root ::= 'a'"}):
        with pytest.raises(InvalidRequestError):
            structured_text(spec)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    ids, eos = scripted_answer({"json": SCHEMA}, str(tiny_model_dir))
    assert ids[-1] == eos == tok.eos_token_id
    assert json.loads(tok.decode(ids, skip_special_tokens=True)) == json.loads(structured_text({"json": SCHEMA}))
    with pytest.raises(InvalidRequestError, match="--tokenizer"):
        scripted_answer({"json_object": True}, "")


@pytest.mark.parametrize("schema", [
    {"type": "array", "minItems": 10**12},
    {"type": "array", "minItems": 10**3, "items": {"type": "array", "minItems": 10**3, "items": {
        "type": "array", "minItems": 10**3, "items": {"type": "string", "minLength": 10**9}}}},
    {"type": "object", "required": 5, "properties": []},
    {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer", "minimum": "3", "maximum": None}}},
    {"type": "string", "minLength": "long", "maxLength": -1},
    {"$ref": "#"},
    {"anyOf": "x", "enum": 3},
])
def test_hostile_schemas_give_a_bounded_answer(schema) -> None:
    """A client's schema cannot make the sim's answer (or its tool-call arguments) grow without end
    or crash it: malformed keywords are skipped and sizes are capped."""
    text = structured_text({"json": schema})
    assert len(text) < 1 << 20
    json.loads(text)
