"""Reading, parsing and validating OpenAI completion and chat requests.

Why it exists: the router and the worker must accept and reject the same
requests with the same messages, so the rules live here once: a JSON object
body under a size limit, a non-empty ``model``, one prompt (text or token
ids) or a chat request (``kvmesh.tokenization.chat_render.chat_request_from_body``:
messages, tools, tool_choice, template keywords), sampling fields of the
right type and range (``max_tokens``/``max_completion_tokens`` >= 1,
``temperature`` in [0, 2], ``top_p`` in (0, 1], ``n`` = 1, at most 4
``stop`` strings), boolean ``stream``/``ignore_eos``, object
``stream_options``, structured outputs (``response_format`` and vLLM's
``structured_outputs``, folded into one spec by ``kvmesh.structured_outputs``).
A parameter kvmesh cannot honour (``UNSUPPORTED``: ``logprobs``, ``echo``,
``logit_bias``, the removed ``guided_*`` fields, ...) is refused with a
400 naming it rather than ignored. Each error is a ``BadRequest`` whose
``param`` names the field. What the service does with a valid request
(tokenize, check the model, route) is not here.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import Request

from kvmesh import structured_outputs
from kvmesh.openai.errors import BadRequest
from kvmesh.sampling import KNOBS, knob_error, normalized
from kvmesh.tokenization.chat_render import ChatRenderError, ChatRequest, chat_request_from_body

SESSION_HEADER = "x-session-id"
MAX_STOP = 4


# Integer fields end up in protobuf fields of a fixed width: a value past it is a 400, not a crash.
MAX_TOKENS_LIMIT = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
UINT32_MAX = 2**32 - 1
# JSON nesting deeper than this is refused before parsing (tool schemas need a few tens of levels).
MAX_JSON_DEPTH = 64
# A body that stops arriving for this long (total read time) is answered 408.
BODY_TIMEOUT_S = 60.0


class BodyTooLarge(BadRequest):
    status = 413


def json_depth_over(doc: Any, limit: int) -> bool:
    """Whether a parsed JSON document nests objects/arrays deeper than ``limit``.

    The document is parsed first (``msgspec`` is C and turns runaway nesting into RecursionError),
    then only its containers are walked: a 200k-token chat body has a few hundred of them but tens
    of thousands of brackets and escapes inside its strings, which a scan of the raw text (the
    earlier way) went through one by one in Python (~20 ms)."""
    stack: list[tuple[Any, int]] = [(doc, 1)] if isinstance(doc, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        for child in (node.values() if isinstance(node, dict) else node):
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False


async def read_body(request: Request, max_bytes: int, timeout_s: float = BODY_TIMEOUT_S) -> bytes:
    """The request body, refused (413) as soon as it passes ``max_bytes`` - chunked or not - and
    408 when it has not all arrived within ``timeout_s``; never more than ``max_bytes`` in memory."""
    clen = request.headers.get("content-length")
    if clen and clen.isdigit() and int(clen) > max_bytes:
        raise BodyTooLarge(f"request body over {max_bytes} bytes", "body")
    buf = bytearray()
    try:
        async with asyncio.timeout(timeout_s if timeout_s > 0 else None):
            async for chunk in request.stream():
                if len(buf) + len(chunk) > max_bytes:
                    raise BodyTooLarge(f"request body over {max_bytes} bytes", "body")
                buf += chunk
    except TimeoutError:
        raise BadRequest(f"request body not received within {timeout_s:g} s", "body", status=408,
                         etype="timeout") from None
    return bytes(buf)


def parse_json_body(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """A read body as a JSON object: malformed, nested deeper than ``max_depth`` or not an object -> 400.

    ``msgspec`` parses an agent's 800 KB chat body in ~0.7 ms where ``json`` takes 1.5-13 ms on a
    busy core, on every turn's decision path. It is also stricter: ``NaN``/``Infinity``, numbers
    out of a float's range and lone UTF-16 surrogates are malformed JSON (400), not accepted."""
    try:
        body = msgspec.json.decode(raw or b"null")
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"malformed JSON body: {exc}", "body") from None
    except RecursionError:
        raise BadRequest(f"JSON body nested deeper than {max_depth} levels", "body") from None
    # Few brackets in the whole text cannot nest deeper (token-id prompts cost nothing).
    if raw.count(b"[") + raw.count(b"{") > max_depth and json_depth_over(body, max_depth):
        raise BadRequest(f"JSON body nested deeper than {max_depth} levels", "body")
    if not isinstance(body, dict):
        raise BadRequest("the JSON body must be a JSON object", "body")
    return body


async def read_json(request: Request, max_bytes: int, timeout_s: float = BODY_TIMEOUT_S,
                    max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """The request body as a JSON object: over ``max_bytes`` -> 413, slower than ``timeout_s`` -> 408,
    malformed, nested deeper than ``max_depth`` or not an object -> 400 ``body``."""
    return parse_json_body(await read_body(request, max_bytes, timeout_s), max_depth)


def number(body: dict[str, Any], name: str, kind: type = float) -> Any:
    """``body[name]`` as an int (``kind=int``) or a number; None when absent; bools are refused."""
    v = body.get(name)
    if v is None:
        return None
    ok = isinstance(v, int) if kind is int else isinstance(v, (int, float))
    if not ok or isinstance(v, bool):
        raise BadRequest(f"'{name}' must be {'an integer' if kind is int else 'a number'}, got {v!r}", name)
    return kind(v)


def string(body: dict[str, Any], name: str) -> str:
    """``body[name]`` as a string; '' when absent."""
    v = body.get(name)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise BadRequest(f"'{name}' must be a string", name)
    return v


def boolean(body: dict[str, Any], name: str) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise BadRequest(f"'{name}' must be a boolean", name)
    return v


def _is_token_list(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


@dataclass
class OpenAIRequest:
    """A validated completion or chat request; None = the client did not set the field."""

    chat: bool
    model: str
    body: dict[str, Any]                     # the raw body, for service-specific extensions
    prompt_text: str | None = None           # completions: a text prompt ...
    prompt_ids: list[int] | None = None      # ... or token ids
    messages: list[dict[str, Any]] | None = None  # chat: the messages as sent
    chat_request: ChatRequest | None = None       # chat: what decides the prompt (messages, tools, ...)
    add_generation_prompt: bool = True
    tools: list[Any] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool | None = None
    knobs: dict[str, float] = field(default_factory=dict)   # kvmesh.sampling's, as sent
    structured_outputs: dict[str, Any] | None = None         # kvmesh.structured_outputs' spec
    include_reasoning: bool = True   # vLLM's: false drops a reasoning model's reasoning from the answer
    stream: bool = False
    include_usage: bool = False
    cache_salt: str = ""
    session_id: str = ""


def _off(v: Any) -> bool:
    return v is None or v is False


def _zero(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0)


def _one(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v == 1)


def _empty(v: Any) -> bool:
    return v is None or v == {} or v == [] or v == ""


_GUIDED = "the guided_* fields were removed (as in vLLM); use 'structured_outputs' or 'response_format'"

# Parameters the engines cannot honour, each with the test for "not asked for" (a default value
# that changes nothing is accepted): anything else gets a 400 naming it, never silence.
UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "logprobs": (_off, "log probabilities are not returned"),
    "top_logprobs": (_zero, "log probabilities are not returned"),
    "prompt_logprobs": (_zero, "log probabilities are not returned"),
    "logit_bias": (_empty, "logit_bias is not supported"),
    "best_of": (_one, "best_of is not supported (1 only)"),
    "use_beam_search": (_off, "beam search is not supported"),
    "suffix": (_empty, "suffix is not supported"),
    "echo": (_off, "echo is not supported"),
    # vLLM removed the guided_* fields and now ignores them silently; kvmesh names their successor.
    "guided_json": (_empty, _GUIDED),
    "guided_regex": (_empty, _GUIDED),
    "guided_choice": (_empty, _GUIDED),
    "guided_grammar": (_empty, _GUIDED),
    "functions": (_empty, "the legacy 'functions' API is not supported; use 'tools'"),
    "function_call": (_empty, "the legacy 'function_call' API is not supported; use 'tool_choice'"),
    "audio": (_empty, "audio output is not supported"),
    "modalities": (lambda v: v is None or v == ["text"], "only text output is supported"),
    "prediction": (_empty, "predicted outputs are not supported"),
    "web_search_options": (_empty, "web search is not supported"),
    "min_tokens": (_zero, "min_tokens is not supported"),
    "truncate_prompt_tokens": (_empty, "truncate_prompt_tokens is not supported"),
}


# vLLM's values of ``reasoning_effort`` (chat) and ``reasoning.effort`` (Responses).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def reasoning_kwargs(effort: Any, template_kwargs: Any, param: str) -> dict[str, Any]:
    """The template keywords vLLM renders a reasoning effort as: ``reasoning_effort`` and, unless the
    client's ``chat_template_kwargs`` set it, ``enable_thinking`` (false for ``"none"``). A template
    that reads neither never sees them, so the prompt, and the prediction, change only where the
    model's own template asks."""
    if effort is None:
        return {}
    if effort not in REASONING_EFFORTS:
        raise BadRequest(f"'{param}' must be one of {list(REASONING_EFFORTS)}, got {effort!r}", param)
    if isinstance(template_kwargs, dict) and "enable_thinking" in template_kwargs:
        return {"reasoning_effort": effort}
    return {"reasoning_effort": effort, "enable_thinking": effort != "none"}


def refuse_unsupported(body: dict[str, Any]) -> None:
    """A 400 naming the first parameter the engine cannot honour."""
    for name, (unset, why) in UNSUPPORTED.items():
        if name in body and not unset(body[name]):
            raise BadRequest(f"'{name}' is not supported by this server: {why}", name)


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None or model == "":
        raise BadRequest("'model' is required", "model")
    return string(body, "model")


def _common(req: OpenAIRequest, body: dict[str, Any], headers: Any) -> OpenAIRequest:
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    mt = number(body, key, int)
    if mt is not None and not 1 <= mt <= MAX_TOKENS_LIMIT:
        raise BadRequest(f"'{key}' must be in [1, {MAX_TOKENS_LIMIT}], got {mt}", key)
    req.max_tokens = mt
    t = number(body, "temperature")
    if t is not None and not 0 <= t <= 2:
        raise BadRequest(f"'temperature' must be in [0, 2], got {t}", "temperature")
    req.temperature = t
    tp = number(body, "top_p")
    if tp is not None and not 0 < tp <= 1:
        raise BadRequest(f"'top_p' must be in (0, 1], got {tp}", "top_p")
    req.top_p = tp
    req.seed = number(body, "seed", int)
    if req.seed is not None and not INT64_MIN <= req.seed <= INT64_MAX:
        raise BadRequest(f"'seed' must be a 64-bit signed integer, got {req.seed}", "seed")
    n = number(body, "n", int)
    if n is not None and n != 1:
        raise BadRequest("'n' must be 1 (one choice per request)", "n")
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) for s in stops):
            raise BadRequest(f"'stop' must be a string or a list of at most {MAX_STOP} strings", "stop")
        req.stop = [s for s in stops if s]
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                 and 0 <= t <= UINT32_MAX for t in stop_ids):
        raise BadRequest("'stop_token_ids' must be a list of token ids (integers >= 0)", "stop_token_ids")
    req.stop_token_ids = list(stop_ids)
    req.ignore_eos = boolean(body, "ignore_eos")
    for name in KNOBS:
        v = body.get(name)
        if v is not None:
            why = knob_error(name, v)
            if why is not None:
                raise BadRequest(why, name)
            req.knobs[name] = normalized(name, v)
    tool_choice = req.chat_request.tool_choice if req.chat_request is not None else None
    try:
        req.structured_outputs = structured_outputs.from_openai(body.get("response_format"),
                                                                body.get("structured_outputs"), tool_choice)
    except structured_outputs.StructuredOutputsError as exc:
        raise BadRequest(exc.message, exc.param) from None
    req.stream = bool(boolean(body, "stream"))
    opts = body.get("stream_options")
    opts = {} if opts is None else opts
    if not isinstance(opts, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    req.include_usage = bool(opts.get("include_usage"))
    req.cache_salt = string(body, "cache_salt")
    user = body.get("user")
    req.session_id = (string(body, "session_id") or headers.get(SESSION_HEADER, "")
                      or (user if isinstance(user, str) else ""))
    return req


def parse_completion(body: dict[str, Any], headers: Any) -> OpenAIRequest:
    """``/v1/completions``: ``prompt`` is a string, a list of token ids, or a one-element list of either."""
    req = OpenAIRequest(chat=False, model=_model(body), body=body)
    refuse_unsupported(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or _is_token_list(prompt[0])):
        prompt = prompt[0]
    if _is_token_list(prompt):
        req.prompt_ids = list(prompt)
    elif isinstance(prompt, str):
        if not prompt:
            raise BadRequest("'prompt' is empty", "prompt")
        req.prompt_text = prompt
    elif prompt is None:
        raise BadRequest("'prompt' is required", "prompt")
    elif isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(t, int) for t in prompt):
        raise BadRequest("batched prompts are not supported: send one prompt per request", "prompt")
    else:
        raise BadRequest("'prompt' must be a non-empty string or list of token ids (one prompt per request)",
                         "prompt")
    return _common(req, body, headers)


def parse_chat(body: dict[str, Any], headers: Any) -> OpenAIRequest:
    """``/v1/chat/completions``: the rendering fields (``kvmesh.tokenization.chat_render``) and sampling."""
    req = OpenAIRequest(chat=True, model=_model(body), body=body)
    refuse_unsupported(body)
    try:
        req.chat_request = chat_request_from_body(body)
    except ChatRenderError as exc:
        raise BadRequest(exc.message, exc.param) from None
    req.messages = req.chat_request.messages
    req.add_generation_prompt = req.chat_request.add_generation_prompt
    req.tools = req.chat_request.tools
    req.include_reasoning = boolean(body, "include_reasoning") is not False
    effort = reasoning_kwargs(body.get("reasoning_effort"), body.get("chat_template_kwargs"), "reasoning_effort")
    req.chat_request.engine_kwargs = {**req.chat_request.engine_kwargs, **effort}
    return _common(req, body, headers)
