"""An OpenAI Responses request (``POST /v1/responses``) as the chat request it renders to.

Why it exists: OpenAI's Codex CLI and the Agents SDK speak the Responses API, not chat
completions. The model sees the same prompt either way, so a Responses body is turned into
a chat-completions body and then checked by the same rules as ``/v1/chat/completions``
(``kvmesh.openai.requests.parse_chat``): one renderer, one tokenizer, one set of sampling
checks. The item conversion follows vLLM's ``/v1/responses`` (``construct_input_messages``
in ``vllm/entrypoints/openai/responses/utils.py``), so that a router in front of
``vllm serve`` predicts the prompt vLLM renders:

- ``instructions`` is a first ``system`` message; a string ``input`` is one ``user`` message;
- message items keep their role and content parts (``input_text``/``output_text`` are text);
  an assistant message item contributes its first part's text;
- a ``function_call`` item joins the preceding assistant message's ``tool_calls`` (or starts
  one), and a ``function_call_output`` item is a ``tool`` message;
- a ``custom`` (free-form text) tool is shown as vLLM's shim, a function of one string ``input``;
  its ``custom_tool_call`` items are calls of that function and its outputs ``tool`` messages;
- a ``reasoning`` item's text is the assistant's ``reasoning``; encrypted reasoning is refused;
- flat function tools (``{"type": "function", "name", ...}``) become chat tools, and
  ``{"type": "function", "name"}`` as ``tool_choice`` names one; a ``namespace`` tool's functions
  are chat tools named ``<namespace>__<name>`` (``get_function_tools``), and hosted tools are left
  out of the prompt, as vLLM leaves them out;
- ``text.format`` (``json_schema``, ``json_object``) is the chat API's ``response_format``
  (structured outputs, ``kvmesh.structured_outputs``), as vLLM's ``extract_structured_outputs``.

What cannot be honoured gets a 400 naming the field rather than silence: state kept by the
server (``previous_response_id``, ``conversation``, ``item_reference``, ``background``; the router
puts stored state back into the body before this parse, ``kvmesh.responses_api.history``),
a ``tool_choice`` naming a hosted tool, grammar-constrained custom tools, images and files, and
log probabilities; the last are an external engine's to honour when the router forwards to
``vllm serve`` (``engine_renders``). ``reasoning.effort`` is rendered as vLLM renders it (the
template keywords ``reasoning_effort`` and ``enable_thinking``). ``background`` is taken out
before this parse where it is honoured (``kvmesh_router.responses_background``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvmesh.openai.errors import BadRequest
from kvmesh.openai.requests import OpenAIRequest, parse_chat, reasoning_kwargs, string

# Chat fields a Responses body may carry under the same name and meaning (vLLM's extensions
# included); copied into the chat body as they are.
_SAME_NAME = ("model", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
              "repetition_penalty", "seed", "parallel_tool_calls", "stream", "cache_salt", "session_id",
              "chat_template_kwargs", "kvmesh_policy", "lora_name", "include_reasoning")
_ROLES = ("user", "system", "developer", "assistant")
# Item types that need state this server does not keep, or tools it does not run.
_STATEFUL = {"item_reference": "items are not stored by this server; send the item itself"}
MAX_METADATA_KEYS = 16


def _null(v: Any) -> bool:
    return v is None or v is False or v == {} or v == []


# Fields refused unless absent (or their no-op value), each with the reason given in the 400.
_REFUSED: dict[str, tuple[Any, str]] = {
    "previous_response_id": (_null, "responses are not stored by this server; send the whole conversation "
                                    "as 'input' (as clients do with store: false)"),
    "conversation": (_null, "conversations are not stored by this server; send the whole conversation as "
                            "'input'"),
    "background": (_null, "background responses are run by the router's own front door, over its own "
                          "workers, with its response store"),
    "prompt": (_null, "stored prompt templates are not supported"),
    "logit_bias": (_null, "logit_bias is not supported"),
}


@dataclass
class ResponsesRequest:
    """A validated Responses request: the chat request it renders to, and what the answer echoes."""

    chat: OpenAIRequest
    body: dict[str, Any]
    instructions: str | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)   # as sent (flat), echoed
    tool_choice: Any = "auto"
    metadata: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    custom_tools: frozenset[str] = frozenset()   # names of the freeform (``custom``) tools
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)   # flat name -> (namespace, name)

    @property
    def stream(self) -> bool:
        return self.chat.stream


def _refuse(body: dict[str, Any]) -> None:
    for name, (unset, why) in _REFUSED.items():
        if name in body and not unset(body[name]):
            raise BadRequest(f"'{name}' is not supported by this server: {why}", name)


def _refuse_engine_only(body: dict[str, Any]) -> None:
    """What only an engine with its own ``/v1/responses`` honours (``vllm serve``: reasoning
    parsers, log probabilities, truncation)."""
    if body.get("top_logprobs") not in (None, 0):
        raise BadRequest("'top_logprobs' is not supported by this server: log probabilities are not returned",
                         "top_logprobs")
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise BadRequest("'reasoning' must be an object", "reasoning")
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
            raise BadRequest("'include' must be a list of strings", "include")
        if "message.output_text.logprobs" in include:
            raise BadRequest("'include' asks for log probabilities, which are not returned", "include")
    if body.get("truncation") not in (None, "disabled"):
        raise BadRequest("'truncation' must be 'disabled': this server never drops input", "truncation")


def _text_parts(where: str, content: Any) -> Any:
    """A message item's content, checked: a string or a list of text parts (images and files are refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or a list of content parts", where)
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_image", "input_file", "input_audio"):
            raise BadRequest(f"{where}.content[{j}]: '{kind}' is not supported by this server (text only)", where)
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise BadRequest(f"{where}.content[{j}]: part type {kind!r} is not supported (input_text, output_text, "
                             "refusal)", where)
    return content


def _assistant(prev: list[dict[str, Any]]) -> dict[str, Any] | None:
    return prev[-1] if prev and prev[-1].get("role") == "assistant" else None


def _call_output(where: str, output: Any) -> Any:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return _text_parts(where, output)
    raise BadRequest(f"{where}.output must be a string or a list of text parts", where)


def _item(where: str, item: Any, msgs: list[dict[str, Any]]) -> None:
    """Append ``item`` to ``msgs`` as vLLM does (merging into the previous assistant message)."""
    if not isinstance(item, dict):
        raise BadRequest(f"{where} must be an object", where)
    kind = item.get("type", "message")
    prev = _assistant(msgs)
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise BadRequest(f"{where}.role must be one of {', '.join(_ROLES)}", where)
        content = _text_parts(where, item.get("content"))
        if role != "assistant":
            msgs.append({"role": role, "content": content})
            return
        text = content if isinstance(content, str) else (content[0].get("text") if content else None)
        if text is None:   # a refusal part has no text: the parts go to the renderer as they are
            msgs.append({"role": "assistant", "content": content})
        elif prev is not None and prev.get("content") is None:
            prev["content"] = text
        else:
            msgs.append({"role": "assistant", "content": text})
    elif kind == "function_call":
        call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "")
        if not isinstance(call_id, str) or not isinstance(name, str) or not name or not isinstance(args, str):
            raise BadRequest(f"{where}: a function_call needs string 'call_id', 'name' and 'arguments'", where)
        ns = item.get("namespace")
        if ns is not None and (not isinstance(ns, str) or not ns):
            raise BadRequest(f"{where}: a function_call's 'namespace' must be a non-empty string", where)
        if ns:   # vLLM renders a namespace's call under its flat name
            name = flat_name(ns, name)
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
        if prev is not None:
            prev.setdefault("tool_calls", []).append(call)
        else:
            msgs.append({"role": "assistant", "tool_calls": [call]})
    elif kind == "custom_tool_call":
        call_id, name, payload = item.get("call_id"), item.get("name"), item.get("input") or ""
        if not isinstance(call_id, str) or not isinstance(name, str) or not name or not isinstance(payload, str):
            raise BadRequest(f"{where}: a custom_tool_call needs string 'call_id', 'name' and 'input'", where)
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": shim_arguments(payload)}}
        if prev is not None:
            prev.setdefault("tool_calls", []).append(call)
        else:
            msgs.append({"role": "assistant", "tool_calls": [call]})
    elif kind in ("function_call_output", "custom_tool_call_output"):
        call_id = item.get("call_id")
        if not isinstance(call_id, str):
            raise BadRequest(f"{where}: a {kind} needs a string 'call_id'", where)
        msgs.append({"role": "tool", "tool_call_id": call_id, "content": _call_output(where, item.get("output"))})
    elif kind == "reasoning":
        if item.get("encrypted_content"):
            raise BadRequest(f"{where}: encrypted reasoning is not supported by this server", where)
        parts = item.get("content") or item.get("summary") or []
        first = parts[0] if isinstance(parts, list) and parts else {}
        text = first.get("text", "") if isinstance(first, dict) else ""
        if not isinstance(text, str):
            raise BadRequest(f"{where}: reasoning text must be a string", where)
        if prev is not None and prev.get("reasoning") is None:
            prev["reasoning"] = text
        else:
            msgs.append({"role": "assistant", "reasoning": text})
    elif kind in _STATEFUL:
        raise BadRequest(f"{where}: {_STATEFUL[kind]}", where)
    else:
        raise BadRequest(f"{where}: item type {kind!r} is not supported by this server (message, function_call, "
                         "function_call_output, custom_tool_call, custom_tool_call_output, reasoning)", where)


def input_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of ``instructions`` and ``input``."""
    msgs: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("'instructions' must be a string", "instructions")
    if instructions:
        msgs.append({"role": "system", "content": instructions})
    inp = body.get("input")
    if inp is None:
        raise BadRequest("'input' is required", "input")
    if isinstance(inp, str):
        if not inp:
            raise BadRequest("'input' is empty", "input")
        msgs.append({"role": "user", "content": inp})
    elif isinstance(inp, list) and inp:
        for i, item in enumerate(inp):
            _item(f"input[{i}]", item, msgs)
    else:
        raise BadRequest("'input' must be a non-empty string or a non-empty list of items", "input")
    return msgs


# vLLM's shim for a freeform (``custom``) tool: the model sees a function of one string argument.
CUSTOM_INPUT_KEY = "input"
CUSTOM_PARAMETERS = {"type": "object",
                     "properties": {CUSTOM_INPUT_KEY: {"type": "string",
                                                       "description": "The freeform text payload for this tool."}},
                     "required": [CUSTOM_INPUT_KEY], "additionalProperties": False}


def shim_arguments(payload: str) -> str:
    """A custom tool call's input as the shim function's arguments."""
    return json.dumps({CUSTOM_INPUT_KEY: payload}, ensure_ascii=False)


def shim_payload(arguments: str) -> str:
    """The shim function's arguments back as the custom tool's input (bare text passes through)."""
    try:
        doc = json.loads(arguments)
    except ValueError:
        return arguments
    v = doc.get(CUSTOM_INPUT_KEY) if isinstance(doc, dict) else None
    return v if isinstance(v, str) else arguments


# OpenAI's hosted tools: run by OpenAI's servers, never shown to a model served here. vLLM's
# ``get_function_tools`` leaves them out of the prompt, so the model cannot call them; so does kvmesh
# (Codex sends ``web_search`` on every turn). Naming one in ``tool_choice`` is still a 400.
HOSTED_TOOLS = frozenset({
    "web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26",
    "file_search", "computer_use_preview", "computer_use", "computer", "mcp", "code_interpreter",
    "image_generation", "local_shell", "shell", "apply_patch", "tool_search"})
# vLLM's flat name of a function inside a ``namespace`` tool (``vllm.tool_parsers.utils``).
NAMESPACE_SEPARATOR = "__"


def flat_name(namespace: str, name: str) -> str:
    """The name vLLM shows the model for function ``name`` of a ``namespace`` tool."""
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}"


def _function(where: str, t: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    if not isinstance(t.get("name"), str) or not t["name"]:
        raise BadRequest(f"{where}.name must be a non-empty string", where)
    fn = {k: v for k, v in t.items() if k != "type"}
    if name is not None:
        fn["name"] = name
    return {"type": "function", "function": fn}


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """The tools the model is shown, in request order, as vLLM's ``get_function_tools`` makes them:
    flat function tools; the functions of a ``namespace`` tool, named ``<namespace>__<name>``; custom
    tools as vLLM's one-string shim. Hosted tools (``HOSTED_TOOLS``) are left out, as vLLM leaves them
    out; an unknown tool type, and a custom tool constrained by a grammar (vLLM refuses it too: the shim
    cannot hold the model to it), are refused."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        where = f"tools[{i}]"
        if kind == "function":
            out.append(_function(where, t))
        elif kind == "namespace":
            ns, inner = t.get("name"), t.get("tools")
            if not isinstance(ns, str) or not ns or not isinstance(inner, list):
                raise BadRequest(f"{where}: a namespace needs a string 'name' and a list of 'tools'", where)
            for j, f in enumerate(inner):
                if isinstance(f, dict) and f.get("type") == "function":
                    out.append(_function(f"{where}.tools[{j}]", f, flat_name(ns, str(f.get("name")))))
        elif kind == "custom":
            if not isinstance(t.get("name"), str) or not t["name"]:
                raise BadRequest(f"{where}.name must be a non-empty string", where)
            fmt = t.get("format")
            if isinstance(fmt, dict) and fmt.get("type") == "grammar":
                raise BadRequest(f"{where}.format: custom tools with a grammar are not supported by this "
                                 "server (free-form text only)", where)
            out.append({"type": "function", "function": {"name": t["name"], "description": t.get("description"),
                                                         "parameters": CUSTOM_PARAMETERS}})
        elif kind not in HOSTED_TOOLS:
            raise BadRequest(f"{where}: tool type {kind!r} is not supported by this server (function, namespace "
                             "and custom tools; hosted tools are not shown to the model)", where)
    return out or None


def namespaced_names(tools: Any) -> dict[str, tuple[str, str]]:
    """The flat name of each function in a ``namespace`` tool -> (namespace, its own name): an answer's
    call of a flat name is reported as that function with its ``namespace``, as vLLM reports it."""
    out: dict[str, tuple[str, str]] = {}
    for t in tools or []:
        if isinstance(t, dict) and t.get("type") == "namespace" and isinstance(t.get("tools"), list):
            for f in t["tools"]:
                if isinstance(f, dict) and f.get("type") == "function" and isinstance(f.get("name"), str):
                    out[flat_name(t["name"], f["name"])] = (t["name"], f["name"])
    return out


def _custom_names(tools: Any) -> frozenset[str]:
    return frozenset(t["name"] for t in tools or [] if t.get("type") == "custom")


def chat_tool_choice(choice: Any, tools: Any = None, flat: dict[str, tuple[str, str]] | None = None) -> Any:
    """A Responses ``tool_choice`` as the chat one. A named function may be a namespace's (``flat``:
    ``namespaced_names(tools)``), by its flat name or, when only one namespace has it, by its own
    (vLLM's ``_resolve_named_tool_choice``)."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        name = choice.get("name")
        if not isinstance(name, str):
            raise BadRequest(f"'tool_choice' {{\"type\": \"{choice['type']}\"}} needs a string 'name'", "tool_choice")
        flat = namespaced_names(tools) if flat is None else flat
        plain = {t.get("name") for t in tools or [] if isinstance(t, dict) and t.get("type") != "namespace"}
        if name not in flat and name not in plain:
            candidates = [f for f, (_, own) in flat.items() if own == name]
            if len(candidates) > 1:
                raise BadRequest(f"Tool choice '{name}' is ambiguous: it is defined in more than one namespace "
                                 f"({', '.join(candidates)}). Select it by its full '<namespace>__<name>' name.",
                                 "tool_choice")
            name = candidates[0] if candidates else name
        return {"type": "function", "function": {"name": name}}
    raise BadRequest("'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\" (or \"custom\"), "
                     "\"name\": ...}", "tool_choice")


def checked_metadata(md: Any, max_chars: tuple[int, int] | None = None) -> dict[str, str]:
    """``metadata``: at most ``MAX_METADATA_KEYS`` string values ({} when absent); with ``max_chars``, keys
    and values at most that long too (the Conversations API's bounds)."""
    if md is None:
        return {}
    if (not isinstance(md, dict) or len(md) > MAX_METADATA_KEYS
            or not all(isinstance(k, str) and isinstance(v, str)
                       and (max_chars is None or (len(k) <= max_chars[0] and len(v) <= max_chars[1]))
                       for k, v in md.items())):
        bounds = f" (keys up to {max_chars[0]} characters, values up to {max_chars[1]})" if max_chars else ""
        raise BadRequest(f"'metadata' must be an object of at most {MAX_METADATA_KEYS} string values{bounds}",
                         "metadata")
    return md


def text_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """``text.format`` as the chat API's ``response_format`` (vLLM's ``extract_structured_outputs``:
    ``json_schema`` constrains to its ``schema``, ``json_object`` to any object, ``text`` not at all);
    None when absent."""
    text = body.get("text")
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(text, dict) or (fmt is not None and not isinstance(fmt, dict)):
        raise BadRequest("'text' must be an object whose 'format' is an object", "text")
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        out: dict[str, Any] = {"type": kind}
    elif kind == "json_schema":
        if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict):
            raise BadRequest("'text.format' json_schema needs a string 'name' and a 'schema' object", "text")
        out = {"type": "json_schema", "json_schema": {"name": fmt["name"], "schema": fmt["schema"],
                                                      "strict": fmt.get("strict")}}
    else:
        raise BadRequest(f"'text.format.type' must be text, json_object or json_schema, got {kind!r}", "text")
    if body.get("structured_outputs") is not None:
        raise BadRequest("Cannot specify both structured_outputs and text.format", "structured_outputs")
    return out


def _as_responses_error(exc: BadRequest) -> BadRequest:
    """A chat check's error in the Responses request's own words."""
    renames = {"max_tokens": "max_output_tokens", "response_format": "text"}
    param = exc.param or ""
    if param.startswith("messages"):
        return BadRequest(exc.message.replace("messages", "input (as chat messages)", 1), "input")
    if param in renames:
        return BadRequest(exc.message.replace(param, renames[param]), renames[param])
    return exc


def _reasoning_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM renders ``reasoning.effort`` as the chat ``reasoning_effort`` (``openai.requests.reasoning_kwargs``)."""
    reasoning = body.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    return reasoning_kwargs(effort, body.get("chat_template_kwargs"), "reasoning")


def parse_responses(body: dict[str, Any], headers: Any, engine_renders: bool = False) -> ResponsesRequest:
    """Check a ``/v1/responses`` body and build its chat request (``BadRequest`` names a bad field).

    ``engine_renders``: the body goes on to an engine with its own ``/v1/responses``, which honours
    what kvmesh workers cannot (``_refuse_engine_only``); the chat request is then only the prediction
    of the prompt that engine renders."""
    _refuse(body)
    if not engine_renders:
        _refuse_engine_only(body)
    chat_body: dict[str, Any] = {k: body[k] for k in _SAME_NAME if k in body}
    chat_body["messages"] = input_messages(body)
    tools = chat_tools(body.get("tools"))
    namespaced = namespaced_names(body.get("tools"))
    if tools is not None:
        chat_body["tools"] = tools
    if body.get("tool_choice") is not None:
        chat_body["tool_choice"] = chat_tool_choice(body["tool_choice"], body.get("tools"), namespaced)
    if body.get("max_output_tokens") is not None:
        chat_body["max_tokens"] = body["max_output_tokens"]
    fmt = text_format(body)
    if fmt is not None:
        chat_body["response_format"] = fmt
    elif body.get("structured_outputs") is not None:   # vLLM's extension, on this API too
        chat_body["structured_outputs"] = body["structured_outputs"]
    # OpenAI's cache key is the session the prefix belongs to: kvmesh's session hint.
    session = string(body, "prompt_cache_key") or string(body, "session_id")
    if session:
        chat_body["session_id"] = session
    user = body.get("user")
    if user is not None:
        chat_body["user"] = string(body, "user")
    try:
        chat = parse_chat(chat_body, headers)
    except BadRequest as exc:
        raise _as_responses_error(exc) from None
    if chat.chat_request is not None:
        # vLLM's /v1/responses hands the template the messages it built, not re-parsed ones.
        chat.chat_request.call_key_order = ("name", "arguments")
        chat.chat_request.engine_kwargs = _reasoning_kwargs(body)
    return ResponsesRequest(chat=chat, body=body, instructions=body.get("instructions"),
                            tools=list(body.get("tools") or []),
                            tool_choice=body.get("tool_choice") if body.get("tool_choice") is not None else "auto",
                            metadata=checked_metadata(body.get("metadata")), user=user, custom_tools=_custom_names(body["tools"] if tools else None),
                            namespaced=namespaced)
