"""Validating a Messages request and converting it to the chat conversation the template renders.

Why it exists: an Anthropic request (``system``, content blocks, ``tool_use``
and ``tool_result`` blocks, tools with ``input_schema``) must become the
OpenAI-style ``messages``/``tools`` a model's chat template takes, and it must
become exactly what vLLM's own ``/v1/messages`` makes of it
(``vllm.entrypoints.anthropic.serving``), so the prompt kvmesh hashes is the
prompt an engine serving Anthropic traffic computes:

* ``system`` text blocks are joined with no separator, skipping Claude Code's
  per-request ``x-anthropic-billing-header`` block (its hash would defeat
  prefix caching); an inline ``system`` message is kept where it stands;
* one text block becomes a string; several stay a list of text parts (the
  template joins them); empty text blocks are dropped;
* ``tool_use`` becomes an assistant ``tool_calls`` entry whose ``arguments``
  is ``json.dumps(input)``; each ``tool_result`` becomes a ``tool`` message
  (its text blocks joined with ``"\\n"``) placed before the rest of its user
  message; a user message holding only tool results adds no user turn;
* ``thinking`` blocks become the message's ``reasoning``; ``redacted_thinking``
  is dropped;
* with a chat template that wants the system prompt first (``needs_system_first``:
  it fails on ``[system, user, system, user]``, e.g. Qwen's), vLLM merges inline
  ``system`` messages into the leading one (``merge_inline_system``).

Keys are even in vLLM's order (the one its request validation leaves, e.g. a
tool call's ``function`` is ``{arguments, name}``), because a template that
writes a dict with ``tojson`` writes its keys in order.

What kvmesh cannot honour is refused with a 400 whose message names the field,
never ignored: image and document blocks (text-only models), server tools,
context edits that would drop history, a region, ``max_tokens`` 0 (cache pre-warming), unknown
fields. ``thinking`` is read as vLLM reads it (``_thinking``): ``adaptive`` changes nothing,
``disabled`` is a reasoning effort, ``enabled`` a thinking token budget;
``output_config.effort`` is the chat ``reasoning_effort``, as vLLM renders it;
``output_config.format`` (a JSON schema) is structured output, the chat API's
``response_format`` ``json_schema`` as vLLM maps it (``kvmesh.structured_outputs``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvmesh.anthropic.errors import bad_request
from kvmesh.openai.requests import MAX_TOKENS_LIMIT, reasoning_kwargs
from kvmesh.sampling import INT32_MAX

SESSION_HEADER = "x-session-id"
BILLING_HEADER = "x-anthropic-billing-header"
MAX_STOP_SEQUENCES = 16
MAX_STOP_BYTES = 256
MAX_USER_ID = 256
_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")
_ROLES = ("user", "assistant", "system")
# kvmesh extensions, as on the OpenAI endpoints.
_EXTENSIONS = {"cache_salt", "kvmesh_policy", "lora_name"}
# ``cache_control`` asks for prompt caching, which the engines' prefix cache does on its own;
# ``user_profile_id``/``workspace_id`` identify the caller and change nothing here.
_PROMPT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking", "cache_control", "speed",
                  "user_profile_id", "workspace_id", "output_config", "context_management", *_EXTENSIONS}
MESSAGES_FIELDS = _PROMPT_FIELDS | {"max_tokens", "stop_sequences", "temperature", "top_p", "top_k", "stream",
                                    "metadata", "service_tier", "inference_geo", "diagnostics"}
COUNT_FIELDS = _PROMPT_FIELDS
_NOT_SUPPORTED = {
    "output_format": "the beta 'output_format' is now 'output_config.format'",
    "container": "code-execution containers are not supported by this server",
    "mcp_servers": "MCP servers are not supported by this server",
}


@dataclass
class MessagesRequest:
    """A validated Messages (or count_tokens) request, already in chat form; None = not set."""

    model: str
    body: dict[str, Any]                     # the raw body, for service extensions
    messages: list[dict[str, Any]]           # OpenAI-style conversation for the chat template
    tools: list[dict[str, Any]] | None = None          # OpenAI-style function tools
    tool_choice: str | dict[str, Any] | None = None    # OpenAI-style: auto, required, none or a named function
    # OpenAI's parallel_tool_calls: false when tool_choice.disable_parallel_tool_use is true (as vLLM maps it).
    parallel_tool_calls: bool = True
    max_tokens: int | None = None
    stop_sequences: list[str] = field(default_factory=list)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    session_id: str = ""
    structured_outputs: dict[str, Any] | None = None   # output_config.format (kvmesh.structured_outputs)
    # Chat template keywords vLLM's /v1/messages adds (output_config.effort -> reasoning_effort); a
    # template that does not read one never sees it (kvmesh.tokenization.chat_render).
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # ``thinking: {"type": "disabled"}``: vLLM renders it as a reasoning effort of its own choosing
    # (the router's ``AnthropicApi`` makes the same choice).
    thinking_disabled: bool = False
    thinking_budget: int | None = None   # thinking "enabled": vLLM's thinking_token_budget


# -- typed field readers ----------------------------------------------------------------------

def _string(v: Any, where: str, *, required: bool = False, empty_ok: bool = True) -> str | None:
    if v is None:
        if required:
            raise bad_request(where, "Field required")
        return None
    if not isinstance(v, str):
        raise bad_request(where, f"must be a string, got {type(v).__name__}")
    if not v and not empty_ok:
        raise bad_request(where, "must not be empty")
    return v


def _int(body: dict[str, Any], name: str, lo: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool):
        raise bad_request(name, f"must be an integer, got {v!r}")
    if v < lo:
        raise bad_request(name, f"must be >= {lo}, got {v}")
    return v


def _number(body: dict[str, Any], name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise bad_request(name, f"must be a number, got {v!r}")
    if v > hi or v < lo or (lo_open and v == lo):
        raise bad_request(name, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v}")
    return float(v)


def _bool(body: dict[str, Any], name: str) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise bad_request(name, f"must be a boolean, got {v!r}")
    return v


def _object(v: Any, where: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise bad_request(where, f"must be an object, got {type(v).__name__}")
    return v


# -- content --------------------------------------------------------------------------------

def _unsupported_block(btype: str, where: str) -> Exception:
    if btype in ("image", "document"):
        return bad_request(where, f"{btype} blocks are not supported: this server's model takes text only")
    return bad_request(where, f"unsupported content block type {btype!r}")


def _text_of(block: dict[str, Any], where: str) -> str:
    return _string(block.get("text"), f"{where}.text", required=True) or ""


def _system(system: Any) -> str:
    """The top-level ``system`` as one string ('' when absent)."""
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise bad_request("system", "must be a string or a list of text blocks")
    parts = []
    for j, block in enumerate(system):
        where = f"system.{j}"
        block = _object(block, where)
        if block.get("type") != "text":
            raise bad_request(f"{where}.type", "system blocks must be text blocks")
        text = _text_of(block, where)
        if text and not text.startswith(BILLING_HEADER):
            parts.append(text)
    return "".join(parts)


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    tool_use_id = _string(block.get("tool_use_id"), f"{where}.tool_use_id", required=True, empty_ok=False)
    if block.get("is_error") is not None and not isinstance(block.get("is_error"), bool):
        raise bad_request(f"{where}.is_error", "must be a boolean")
    content = block.get("content")
    if content is None or isinstance(content, str):
        text = content or ""
    elif isinstance(content, list):
        texts = []
        for k, item in enumerate(content):
            item = _object(item, f"{where}.content.{k}")
            if item.get("type") != "text":
                raise _unsupported_block(str(item.get("type")), f"{where}.content.{k}")
            texts.append(_text_of(item, f"{where}.content.{k}"))
        text = "\n".join(texts)
    else:
        raise bad_request(f"{where}.content", "must be a string or a list of text blocks")
    return {"content": text, "role": "tool", "tool_call_id": tool_use_id}


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    tid = _string(block.get("id"), f"{where}.id", required=True, empty_ok=False)
    name = _string(block.get("name"), f"{where}.name", required=True, empty_ok=False)
    args = block.get("input")
    if args is not None and not isinstance(args, dict):
        raise bad_request(f"{where}.input", "must be an object")
    return {"id": tid, "function": {"arguments": json.dumps(args or {}), "name": name}, "type": "function"}


def _convert_message(i: int, msg: Any, out: list[dict[str, Any]]) -> None:
    where = f"messages.{i}"
    msg = _object(msg, where)
    role = msg.get("role")
    if role not in _ROLES:
        raise bad_request(f"{where}.role", f"must be one of 'user', 'assistant' (or 'system'), got {role!r}")
    content = msg.get("content")
    if content is None:
        raise bad_request(f"{where}.content", "Field required")
    if not isinstance(content, (str, list)):
        raise bad_request(f"{where}.content", "must be a string or a list of content blocks")
    if role == "system":
        text = content if isinstance(content, str) else _system(content)
        if text and not text.startswith(BILLING_HEADER):
            out.append({"content": text, "role": "system"})
        return
    if isinstance(content, str):
        out.append({"content": content, "role": role} if role == "user" else {"role": role, "content": content})
        return
    parts: list[dict[str, Any]] = []
    tool_calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for j, block in enumerate(content):
        bwhere = f"{where}.content.{j}"
        block = _object(block, bwhere)
        btype = block.get("type")
        if btype == "text":
            text = _text_of(block, bwhere)
            if text:
                parts.append({"text": text, "type": "text"})
        elif btype == "tool_use":
            if role != "assistant":
                raise bad_request(f"{bwhere}.type", "tool_use blocks belong in assistant messages")
            tool_calls.append(_tool_use(block, bwhere))
        elif btype == "tool_result":
            if role != "user":
                raise bad_request(f"{bwhere}.type", "tool_result blocks belong in user messages")
            out.append(_tool_result(block, bwhere))
        elif btype == "thinking":
            reasoning.append(_string(block.get("thinking"), f"{bwhere}.thinking", required=True) or "")
        elif btype == "redacted_thinking":
            continue   # opaque; accepted so a client can echo a whole assistant turn back
        else:
            raise _unsupported_block(str(btype), bwhere)
    chat: dict[str, Any] = {"role": role}
    if parts:
        chat["content"] = parts[0]["text"] if len(parts) == 1 else parts
    if tool_calls:
        chat["tool_calls"] = tool_calls
    if reasoning:
        chat["reasoning"] = "".join(reasoning)
    if role == "user" and "content" not in chat:
        return   # only tool results: they are the turn
    if role == "user" and isinstance(chat["content"], str):
        chat = {"content": chat["content"], "role": role}
    out.append(chat)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if msgs is None:
        raise bad_request("messages", "Field required")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("messages", "must be a non-empty list")
    out: list[dict[str, Any]] = []
    system = _system(body.get("system"))
    if system:
        out.append({"content": system, "role": "system"})
    for i, m in enumerate(msgs):
        _convert_message(i, m, out)
    return out


# -- tools ------------------------------------------------------------------------------------

def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools", "must be a list")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        tool = _object(tool, where)
        ttype = tool.get("type")
        if ttype not in (None, "custom"):
            raise bad_request(f"{where}.type", f"server tool {ttype!r} is not supported: give custom tools "
                                               "with name, description and input_schema")
        name = _string(tool.get("name"), f"{where}.name", required=True) or ""
        if not _TOOL_NAME.match(name):
            raise bad_request(f"{where}.name", "must match ^[a-zA-Z0-9_-]{1,128}$")
        desc = _string(tool.get("description"), f"{where}.description")
        schema = tool.get("input_schema")
        if schema is None:
            raise bad_request(f"{where}.input_schema", "Field required")
        schema = dict(_object(schema, f"{where}.input_schema"))
        schema.setdefault("type", "object")   # as vLLM does
        fn: dict[str, Any] = {"name": name, "description": desc, "parameters": schema}
        strict = tool.get("strict")
        if strict is not None:
            if not isinstance(strict, bool):
                raise bad_request(f"{where}.strict", "must be a boolean")
            fn["strict"] = strict
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(body: dict[str, Any], tools: list[dict[str, Any]] | None) -> str | dict[str, Any] | None:
    tc = body.get("tool_choice")
    if tc is None:
        return "auto" if tools else None
    tc = _object(tc, "tool_choice")
    kind = tc.get("type")
    if kind not in ("auto", "any", "tool", "none"):
        raise bad_request("tool_choice.type", f"must be one of 'auto', 'any', 'tool', 'none', got {kind!r}")
    dp = tc.get("disable_parallel_tool_use")
    if dp is not None and not isinstance(dp, bool):
        raise bad_request("tool_choice.disable_parallel_tool_use", "must be a boolean")
    if kind in ("any", "tool") and not tools:
        raise bad_request("tool_choice", f"type {kind!r} needs tools")
    if kind == "tool":
        name = _string(tc.get("name"), "tool_choice.name", required=True)
        if name not in {t["function"]["name"] for t in tools or []}:
            raise bad_request("tool_choice.name", f"no tool named {name!r} in tools")
        return {"type": "function", "function": {"name": name}}
    return {"auto": "auto", "any": "required", "none": "none"}[kind]


# -- requests ---------------------------------------------------------------------------------

def _check_fields(body: dict[str, Any], allowed: set[str]) -> None:
    for name in body:
        if name in _NOT_SUPPORTED:
            raise bad_request(name, _NOT_SUPPORTED[name])
        if name not in allowed:
            raise bad_request(name, "Extra inputs are not permitted")
    _context_management(body.get("context_management"))
    if body.get("speed") not in (None, "standard"):
        raise bad_request("speed", "only 'standard' is supported by this server")
    for name, why in (("inference_geo", "this server runs where it is deployed; it cannot pick a region"),
                      ("diagnostics", "cache-miss diagnostics are not supported by this server")):
        if body.get(name) is not None:
            raise bad_request(name, why)
    for name in ("user_profile_id", "workspace_id"):
        _string(body.get(name), name)
    if body.get("cache_control") is not None:
        _object(body["cache_control"], "cache_control")


def _thinking(thinking: Any) -> tuple[bool, int | None]:
    """``thinking``, as vLLM's /v1/messages reads it: ``adaptive`` lets the model choose (Claude Code
    sends it every turn; vLLM pins nothing for it), ``disabled`` is a reasoning effort
    (``disabled_thinking_effort``), ``enabled`` has a token budget of at least 1,024 (Anthropic's and
    vLLM's floor), which becomes vLLM's ``thinking_token_budget``. Returns (disabled, that budget)."""
    if thinking is None:
        return False, None
    thinking = _object(thinking, "thinking")
    kind = thinking.get("type")
    for k in thinking:
        if k not in ("type", "budget_tokens", "display"):
            raise bad_request(f"thinking.{k}", "Extra inputs are not permitted")
    if kind in ("disabled", "adaptive"):
        return kind == "disabled", None
    if kind != "enabled":
        raise bad_request("thinking.type", f"must be 'enabled', 'disabled' or 'adaptive', got {kind!r}")
    budget = thinking.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or not 1024 <= budget <= INT32_MAX:
        raise bad_request("thinking.budget_tokens", f"must be an integer from 1024 to {INT32_MAX}, got {budget!r}")
    return False, budget


def _prompt(body: Any, allowed: set[str]) -> MessagesRequest:
    body = _object(body, "body")
    _check_fields(body, allowed)
    disabled, budget = _thinking(body.get("thinking"))
    model = _string(body.get("model"), "model", required=True, empty_ok=False) or ""
    tools = _tools(body)
    req = MessagesRequest(model=model, body=body, messages=_messages(body), tools=tools)
    req.tool_choice = _tool_choice(body, tools)
    req.parallel_tool_calls = not (isinstance(body.get("tool_choice"), dict)
                                   and body["tool_choice"].get("disable_parallel_tool_use") is True)
    req.structured_outputs = _output_config(body.get("output_config"), req.template_kwargs)
    req.thinking_disabled, req.thinking_budget = disabled, budget
    return req


EFFORTS = ("low", "medium", "high", "xhigh", "max")
# Context edits that leave the prompt as it is: keeping every thinking block (Claude Code asks for
# that every turn). vLLM ignores context_management; an edit that would drop history is refused
# here instead, since the prompt would then not be what the client asked for.
_KEEP_ALL = {"clear_thinking_20251015"}


def _context_management(cm: Any) -> None:
    if cm is None:
        return
    edits = _object(cm, "context_management").get("edits") or []
    if not isinstance(edits, list):
        raise bad_request("context_management.edits", "must be a list")
    for i, e in enumerate(edits):
        e = _object(e, f"context_management.edits.{i}")
        if e.get("type") not in _KEEP_ALL or e.get("keep", "all") != "all":
            raise bad_request(f"context_management.edits.{i}", "only clear_thinking with keep 'all' is supported by "
                                                               "this server (it keeps the whole history)")


def disabled_thinking_effort(render: Callable[[dict[str, Any]], str | None]) -> str:
    """The reasoning effort vLLM's /v1/messages renders ``thinking: {"type": "disabled"}`` as: ``"none"``,
    unless the template renders ``"none"`` like one of the thinking efforts (it ignores the keyword)
    or cannot render it, then ``"low"``. ``render`` renders a one-message conversation with the
    template keywords of an effort (``openai.requests.reasoning_kwargs``); vLLM probes the same way."""
    def prompt(effort: str) -> str | None:
        try:
            return render(reasoning_kwargs(effort, None, "thinking"))
        except Exception:   # a template that refuses the keyword
            return None

    none = prompt("none")
    return "low" if none is None or any(prompt(e) == none for e in EFFORTS) else "none"


def _output_config(config: Any, template_kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """``output_config``: its ``format`` (``{"type": "json_schema", "schema": {...}}``) as a
    structured-outputs spec, as vLLM's ``_handle_output_config`` makes it a ``response_format``, and
    its ``effort`` as the template keyword ``reasoning_effort``, as vLLM renders it."""
    if config is None:
        return None
    config = _object(config, "output_config")
    for k in config:
        if k not in ("format", "effort"):
            raise bad_request(f"output_config.{k}", "Extra inputs are not permitted")
    effort = config.get("effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise bad_request("output_config.effort", f"must be one of {', '.join(EFFORTS)}, got {effort!r}")
        template_kwargs["reasoning_effort"] = effort
    fmt = config.get("format")
    if fmt is None:
        return None
    fmt = _object(fmt, "output_config.format")
    if fmt.get("type") != "json_schema":
        raise bad_request("output_config.format.type", f"must be 'json_schema', got {fmt.get('type')!r}")
    if not isinstance(fmt.get("schema"), dict):
        raise bad_request("output_config.format.schema", "must be a JSON schema object")
    extra = set(fmt) - {"type", "schema"}
    if extra:
        raise bad_request(f"output_config.format.{sorted(extra)[0]}", "Extra inputs are not permitted")
    return {"json": fmt["schema"]}


def parse_count_tokens(body: Any, headers: Any) -> MessagesRequest:
    """``/v1/messages/count_tokens``: the prompt part of a Messages request. It has no session:
    a count (often of a fragment) must not take the place of the session's conversation in the
    router's per-session caches."""
    return _prompt(body, COUNT_FIELDS)


def parse_messages(body: Any, headers: Any) -> MessagesRequest:
    """``/v1/messages``: ``max_tokens`` is required, as Anthropic requires it."""
    req = _prompt(body, MESSAGES_FIELDS)
    body = req.body
    if body.get("max_tokens") is None:
        raise bad_request("max_tokens", "Field required")
    if body.get("max_tokens") == 0:
        raise bad_request("max_tokens", "must be >= 1: pre-warming the cache without an answer is not supported")
    req.max_tokens = _int(body, "max_tokens", 1)
    if req.max_tokens is not None and req.max_tokens > MAX_TOKENS_LIMIT:
        raise bad_request("max_tokens", f"must be <= {MAX_TOKENS_LIMIT}, got {req.max_tokens}")
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise bad_request("stop_sequences", "must be a list of non-empty strings")
        if len(stops) > MAX_STOP_SEQUENCES or any(len(s.encode()) > MAX_STOP_BYTES for s in stops):
            raise bad_request("stop_sequences", f"at most {MAX_STOP_SEQUENCES} sequences of at most "
                                                f"{MAX_STOP_BYTES} bytes")
        req.stop_sequences = list(stops)
    req.temperature = _number(body, "temperature", 0.0, 1.0)
    req.top_p = _number(body, "top_p", 0.0, 1.0, lo_open=True)
    req.top_k = _int(body, "top_k", 1)
    if req.top_k is not None and req.top_k > INT32_MAX:
        raise bad_request("top_k", f"must be at most {INT32_MAX}, got {req.top_k}")
    req.stream = bool(_bool(body, "stream"))
    tier = body.get("service_tier")
    if tier is not None and tier not in ("auto", "standard_only"):
        raise bad_request("service_tier", f"must be 'auto' or 'standard_only', got {tier!r}")
    user_id = ""
    meta = body.get("metadata")
    if meta is not None:
        meta = _object(meta, "metadata")
        for k in meta:
            if k != "user_id":
                raise bad_request(f"metadata.{k}", "Extra inputs are not permitted")
        user_id = _string(meta.get("user_id"), "metadata.user_id") or ""
        if len(user_id) > MAX_USER_ID:
            raise bad_request("metadata.user_id", f"at most {MAX_USER_ID} characters")
    # A session id keeps a conversation's turns together (affinity, incremental hashing and
    # tokenization); Claude Code's metadata.user_id names its session.
    req.session_id = headers.get(SESSION_HEADER, "") or user_id
    return req


def needs_system_first(template: str | None) -> bool:
    """vLLM's test for merging inline system messages: the template fails to render
    ``[system, user, system, user]`` in a sandbox (or there is no template)."""
    if not template:
        return True
    import jinja2.ext
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    msgs = [{"role": r, "content": "t"} for r in ("system", "user", "system", "user")]
    try:
        env.from_string(template).render(messages=msgs, add_generation_prompt=False)
    except jinja2.TemplateError:
        return True
    return False


def merge_inline_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's merge: every system message's text, in order and joined with no separator, as one
    leading system message (none when there is no text)."""
    texts = [m["content"] for m in messages if m.get("role") == "system"]
    rest = [m for m in messages if m.get("role") != "system"]
    text = "".join(texts)
    return ([{"content": text, "role": "system"}] if text else []) + rest
