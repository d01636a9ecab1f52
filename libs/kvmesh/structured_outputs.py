"""Structured outputs (JSON schema, JSON object, regex, choice, grammar): one spec from every door.

Why it exists: agents ask for output in a shape. The OpenAI Agents SDK's ``output_type`` and the
``openai`` client's ``parse`` helpers send ``response_format`` ``json_schema``; Codex's
``--output-schema`` sends the Responses API's ``text.format``; vLLM's own clients send its
``structured_outputs`` extension. vLLM serves them all by constraining decoding
(``SamplingParams.structured_outputs``), and the prompt does not change, so routing is unaffected.

The spec is the keyword arguments of vLLM's ``StructuredOutputsParams`` as a JSON object. Every
door folds its request into it the way vLLM's server does
(``structured_outputs_from_response_format``): ``response_format`` ``json_object`` sets
``json_object``, ``json_schema`` sets ``json`` to the schema, over what ``structured_outputs``
held; ``text`` changes nothing. The spec travels in ``common.v1.SamplingParams
.structured_outputs_json``, and each service checks it with ``spec_error`` before using it, so a
bad one is a 400 (INVALID_ARGUMENT) at the router and again at a worker reached directly.

The rules are vLLM's: exactly one kind of constraint (``json``, ``regex``, ``choice``, ``grammar``
or ``json_object``), and a constraint on the whole output does not combine with a named
``tool_choice``. vLLM's ``structural_tag`` is refused (no door produces it). The constraint's own
syntax (a regex, a grammar, a schema keyword the backend lacks) is checked by the engine that
compiles it: a vLLM worker answers 400 with xgrammar's message.
"""

from __future__ import annotations

import json
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# Options of vLLM's StructuredOutputsParams that go with any kind, and their types.
OPTIONS: dict[str, type] = {"disable_any_whitespace": bool, "disable_additional_properties": bool,
                            "whitespace_pattern": str}
MAX_CHOICES = 4096
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


class StructuredOutputsError(ValueError):
    """A request's structured-output fields are not valid; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def kind(spec: dict[str, Any]) -> str:
    """The spec's constraint (one of ``KINDS``)."""
    return next(k for k in KINDS if spec.get(k) is not None)


def spec_error(spec: Any) -> str | None:
    """Why ``spec`` is not a structured-outputs spec kvmesh serves, or None when it is."""
    if not isinstance(spec, dict):
        return "must be a JSON object"
    unknown = sorted(set(spec) - set(KINDS) - set(OPTIONS))
    if unknown:
        return (f"unknown field '{unknown[0]}'; fields are {', '.join(KINDS)} and options "
                f"{', '.join(OPTIONS)}")
    set_kinds = [k for k in KINDS if spec.get(k) is not None]
    if len(set_kinds) != 1:
        return (f"needs exactly one constraint of {', '.join(KINDS)}, got "
                f"{', '.join(set_kinds) if set_kinds else 'none'}")
    value = spec[set_kinds[0]]
    why = _KIND_CHECKS[set_kinds[0]](value)
    if why:
        return f"'{set_kinds[0]}' {why}"
    for name, typ in OPTIONS.items():
        if spec.get(name) is not None and not isinstance(spec[name], typ):
            return f"'{name}' must be a {'boolean' if typ is bool else 'string'}"
    return None


def _json_check(v: Any) -> str | None:
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            return "must be a JSON schema (an object, or its JSON text)"
    return None if isinstance(v, dict) else "must be a JSON schema (an object, or its JSON text)"


_KIND_CHECKS = {
    "json": _json_check,
    "regex": lambda v: None if isinstance(v, str) and v else "must be a non-empty string",
    "grammar": lambda v: None if isinstance(v, str) and v else "must be a non-empty string",
    "json_object": lambda v: None if v is True else "must be true",
    "choice": lambda v: None if (isinstance(v, list) and 0 < len(v) <= MAX_CHOICES
                                 and all(isinstance(c, str) for c in v))
    else f"must be a list of 1 to {MAX_CHOICES} strings",
}


def _response_format(rf: Any) -> dict[str, Any]:
    """The spec fields an OpenAI chat ``response_format`` sets (none for ``text``)."""
    if not isinstance(rf, dict) or rf.get("type") not in RESPONSE_FORMATS:
        got = rf.get("type") if isinstance(rf, dict) else rf
        raise StructuredOutputsError(f"'response_format.type' must be one of {', '.join(RESPONSE_FORMATS)}, "
                                     f"got {got!r}", "response_format")
    if rf["type"] == "json_object":
        return {"json_object": True}
    if rf["type"] == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise StructuredOutputsError("'response_format.json_schema' must be an object with a 'schema' object",
                                         "response_format")
        if js.get("name") is not None and not isinstance(js["name"], str):
            raise StructuredOutputsError("'response_format.json_schema.name' must be a string", "response_format")
        # OpenAI's schema is optional ("any JSON"); vLLM reads a missing one as {}.
        return {"json": js.get("schema", {})}
    return {}


def from_openai(response_format: Any, structured_outputs: Any, tool_choice: Any = None) -> dict[str, Any] | None:
    """The spec of an OpenAI request's ``response_format`` and vLLM's ``structured_outputs``
    extension (None: unconstrained). Raises ``StructuredOutputsError``."""
    spec: dict[str, Any] = {}
    if structured_outputs is not None:
        if not isinstance(structured_outputs, dict):
            raise StructuredOutputsError("'structured_outputs' must be a JSON object", "structured_outputs")
        if structured_outputs.get("structural_tag") is not None:
            raise StructuredOutputsError("'structured_outputs.structural_tag' is not supported by this server",
                                         "structured_outputs")
        spec = {k: v for k, v in structured_outputs.items() if v is not None and k != "structural_tag"}
        if spec.get("json_object") is False:
            del spec["json_object"]
        if any(spec.get(k) is not None for k in KINDS) and isinstance(tool_choice, dict):
            # vLLM's rule (ChatCompletionRequest.check_structured_outputs_count).
            raise StructuredOutputsError("You can only either use constraints for structured outputs or a named "
                                         "tool_choice, not both", "structured_outputs")
    if response_format is not None:
        # vLLM replaces the fields response_format names and keeps the rest (a second kind left
        # in structured_outputs then fails the one-constraint rule, as in vLLM).
        spec = spec | _response_format(response_format)
    if not spec:
        return None
    why = spec_error(spec)
    if why is not None:
        param = "structured_outputs" if structured_outputs is not None else "response_format"
        raise StructuredOutputsError(f"'{param}': {why}", param)
    return spec


def to_json(spec: dict[str, Any] | None) -> str:
    """The proto field's text ("" = none)."""
    return json.dumps(spec, separators=(",", ":")) if spec else ""


def from_json(text: str) -> dict[str, Any] | None:
    """A proto field's spec, checked. Raises ``StructuredOutputsError``."""
    if not text:
        return None
    try:
        spec = json.loads(text)
    except ValueError as exc:
        raise StructuredOutputsError(f"'structured_outputs_json' is not JSON: {exc}", "structured_outputs") from None
    why = spec_error(spec)
    if why is not None:
        raise StructuredOutputsError(f"'structured_outputs': {why}", "structured_outputs")
    return spec
