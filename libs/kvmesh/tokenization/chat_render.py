"""The one chat renderer: an OpenAI chat request -> the exact token ids vLLM 0.32's OpenAI server makes.

Why it exists: the router hashes the token ids of a request to find the worker holding its
prefix, and the worker (or vLLM behind it) computes them again. Any difference (tools left
out, text parts joined differently, BOS added twice, a template variable missing) silently
zeroes the precise hit rate. So the router (``kvmesh_router``: HTTP, gRPC, the Envoy picker)
and the worker's HTTP API all render through this module, and it follows what vLLM does:

- messages become vLLM's "conversation" (``vllm/renderers/chat_utils.py``): text parts
  (``text``/``input_text``/``output_text``/``refusal``/``thinking``) joined with "\\n" for a
  template that reads content as a string, kept as ``{"type": "text"}`` parts for one that
  loops over it (``content_format``); a tool message's text parts always joined; only the keys
  vLLM keeps (``tool_calls``, ``tool_call_id``, ``name``, ``reasoning``...); tool-call
  ``arguments`` parsed from JSON to objects (not-an-object -> ``{}``); ``developer`` turned
  into ``system`` when the template does not know it; Claude Code's billing header line
  dropped from system text;
- ``tools`` as vLLM's pydantic ``model_dump`` makes them (``description``/``parameters``
  present even when null);
- the template rendered by ``transformers``' ``apply_chat_template`` (its sandbox, ``tojson``,
  ``strftime_now``, special-token variables) with vLLM's keyword merge: request
  ``chat_template_kwargs`` under ``add_generation_prompt``, ``continue_final_message``,
  ``documents``; keys the template cannot receive are refused here (vLLM drops them silently);
- the text tokenized without added special tokens (the template writes BOS itself).

We do not call vLLM's code because the router must not need vLLM installed; a vLLM-tier
contract test (``tests/libs/tokenization/test_chat_render_vllm.py``) checks equality with
vLLM's own renderer on many requests and two templates.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from kvmesh.tokenization.content_format import ContentFormat, detect_content_format

TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
                  "thinking": "thinking"}
# Part keys vLLM knows; any other key of a text part is passed to an "openai"-format template.
_KNOWN_PART_KEYS = frozenset({"type", "text", "refusal", "thinking", "signature", "closed", "uuid",
                              "image_url", "input_audio", "audio_url", "video_url", "file"})
BILLING_HEADER = "x-anthropic-billing-header"
TOOL_CHOICES = ("none", "auto", "required")


class ChatRenderError(ValueError):
    """The request cannot be rendered; ``param`` names the offending field (OpenAI's error ``param``)."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass
class ChatRequest:
    """What of a chat request decides its prompt. Build it with ``chat_request_from_body``."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None               # None: "auto" with tools, "none" without (as vLLM)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, Any]] | None = None
    add_special_tokens: bool = False
    parallel_tool_calls: bool = True      # False: an answer keeps only its first tool call
    # Keywords an engine's own front end adds (vLLM's /v1/responses: ``reasoning_effort`` and
    # ``enable_thinking`` from ``reasoning.effort``): they override the client's, and a template that
    # does not read one drops it silently, as vLLM does, where the client's own are refused.
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    # The key order of a tool call's ``function`` as the engine hands it to the template (whose
    # ``tojson`` prints it): vLLM's chat endpoint re-parses the messages into OpenAI's typed dicts
    # (arguments, name); its /v1/responses builds them itself, name first.
    call_key_order: tuple[str, str] = ("arguments", "name")

    @property
    def effective_tool_choice(self) -> Any:
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def rendered_kwargs(self) -> dict[str, Any]:
        """The template keywords the prompt is rendered with (the engine's own override the
        client's), as a reasoning parser reads them; the renderer drops those its template ignores."""
        return {**self.chat_template_kwargs, **self.engine_kwargs}

    @property
    def tools_active(self) -> bool:
        """Tools are offered and may be called (the answer may hold ``tool_calls``)."""
        return bool(self.tools) and self.effective_tool_choice != "none"


# --------------------------------------------------------------------------- request fields


def _tool_dict(i: int, tool: Any) -> dict[str, Any]:
    """A tool as vLLM's ``ChatCompletionToolsParam.model_dump()`` renders it."""
    p = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise ChatRenderError(f"{p} must be an object", p)
    if tool.get("type", "function") != "function":
        raise ChatRenderError(f"{p}.type must be 'function'", f"{p}.type")
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ChatRenderError(f"{p}.function must be an object with a non-empty string 'name'", f"{p}.function")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise ChatRenderError(f"{p}.function.description must be a string", f"{p}.function.description")
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        raise ChatRenderError(f"{p}.function.parameters must be a JSON schema object", f"{p}.function.parameters")
    out_fn: dict[str, Any] = {"name": fn["name"], "description": fn.get("description"),
                              "parameters": fn.get("parameters")}
    defer = fn.get("defer_loading", tool.get("defer_loading"))
    if fn.get("strict") is not None:
        out_fn["strict"] = fn["strict"]
    if defer is not None:
        out_fn["defer_loading"] = defer
    out: dict[str, Any] = {"type": "function", "function": out_fn}
    if tool.get("defer_loading") is not None:
        out["defer_loading"] = tool["defer_loading"]
    return out


def _tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> Any:
    """vLLM's rules: a tool_choice other than "none" needs tools; a named one must exist."""
    if choice is None or choice == "none":
        return choice
    if not tools:
        raise ChatRenderError("'tool_choice' needs 'tools'", "tool_choice")
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise ChatRenderError(f"'tool_choice' must be one of {TOOL_CHOICES} or a named function, got {choice!r}",
                                  "tool_choice")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ChatRenderError("'tool_choice' must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                              "tool_choice")
    if fn["name"] not in {t["function"]["name"] for t in tools}:
        raise ChatRenderError(f"'tool_choice' names {fn['name']!r}, which is not in 'tools'", "tool_choice")
    return choice


def chat_request_from_body(body: dict[str, Any]) -> ChatRequest:
    """The rendering fields of an OpenAI chat body, checked; ``ChatRenderError`` names a bad field."""
    msgs = body.get("messages")
    if msgs is None:
        raise ChatRenderError("'messages' is required")
    if not isinstance(msgs, list) or not msgs:
        raise ChatRenderError("'messages' must be a non-empty list")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatRenderError(f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]")
        _texts(i, m["role"], m.get("content"))   # the content's shape is checked up front, not at render
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ChatRenderError("'tools' must be a list", "tools")
    tool_dicts = [_tool_dict(i, t) for i, t in enumerate(tools)] if tools else None
    ctk = body.get("chat_template_kwargs")
    if ctk is None:
        ctk = {}
    if not isinstance(ctk, dict):
        raise ChatRenderError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    flags = {}
    for name, default in (("add_generation_prompt", True), ("continue_final_message", False),
                          ("add_special_tokens", False), ("parallel_tool_calls", True)):
        v = body.get(name)
        if v is not None and not isinstance(v, bool):
            raise ChatRenderError(f"'{name}' must be a boolean", name)
        flags[name] = default if v is None else v
    if flags["continue_final_message"] and flags["add_generation_prompt"]:
        raise ChatRenderError("cannot set both 'continue_final_message' and 'add_generation_prompt' "
                              "(set add_generation_prompt to false)", "continue_final_message")
    docs = body.get("documents")
    if docs is not None and (not isinstance(docs, list) or not all(isinstance(d, dict) for d in docs)):
        raise ChatRenderError("'documents' must be a list of objects", "documents")
    if body.get("chat_template") is not None:
        raise ChatRenderError("a per-request 'chat_template' is not accepted; the served model's is used",
                              "chat_template")
    return ChatRequest(messages=msgs, tools=tool_dicts, tool_choice=_tool_choice(body.get("tool_choice"), tool_dicts),
                       chat_template_kwargs=ctk, documents=docs, **flags)


# --------------------------------------------------------------------------- messages -> conversation


def _texts(i: int, role: str, content: Any) -> list[tuple[str, dict[str, Any]]]:
    """A message's text parts as (text, extra keys), in order."""
    if content is None:
        return []
    if isinstance(content, str):
        parts: list[Any] = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        raise ChatRenderError(f"messages[{i}].content must be a string or a list of parts", f"messages[{i}].content")
    out = []
    for j, part in enumerate(parts):
        if isinstance(part, str):
            text, kind, extra = part, "text", {}
        elif isinstance(part, dict):
            kind = part.get("type")
            key = TEXT_PART_KEYS.get(kind) if isinstance(kind, str) else None
            if key is None:
                raise ChatRenderError(f"messages[{i}].content[{j}]: part type {kind!r} is not supported "
                                      f"(text parts only: {', '.join(TEXT_PART_KEYS)})", f"messages[{i}].content")
            text = part.get(key)
            if text is None:
                continue
            if not isinstance(text, str):
                raise ChatRenderError(f"messages[{i}].content[{j}].{key} must be a string", f"messages[{i}].content")
            extra = {k: v for k, v in part.items() if k not in _KNOWN_PART_KEYS}
        else:
            raise ChatRenderError(f"messages[{i}].content[{j}] must be an object", f"messages[{i}].content")
        if role == "system" and kind == "text" and text.startswith(BILLING_HEADER):
            # vLLM drops this line: its value changes every request and would defeat the prefix cache.
            text = text.partition("\n")[2]
            if not text:
                continue
        out.append((text, extra))
    return out


def _arguments(i: int, call: Any) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise ChatRenderError("assistant tool_calls entries must be objects", f"messages[{i}].tool_calls")
    fn = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(fn, dict):
        raise ChatRenderError("only tool_calls of type 'function' are supported", f"messages[{i}].tool_calls")
    args = fn.get("arguments")
    if not args:
        return {}
    if isinstance(args, dict):
        return args
    parsed: Any = None
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            parsed = None   # vLLM keeps the conversation going with {} rather than fail every later turn
    else:
        parsed = args
    return parsed if isinstance(parsed, dict) else {}


def conversation(messages: Sequence[dict[str, Any]], fmt: ContentFormat, template: str = "",
                 call_key_order: tuple[str, str] = ("arguments", "name")) -> list[dict[str, Any]]:
    """The messages as vLLM hands them to the template (a new list; the input is not modified)."""
    conv: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = m["role"]
        texts = _texts(i, role, m.get("content"))
        msg: dict[str, Any] = {"role": role}
        if fmt == "openai" and role != "tool":
            msg["content"] = [{"type": "text", "text": t, **extra} for t, extra in texts]
        else:
            msg["content"] = "\n".join(t for t, _ in texts)
        if role == "assistant":
            calls = m.get("tool_calls")
            if calls is not None:
                if not isinstance(calls, list):
                    raise ChatRenderError("'tool_calls' must be a list", f"messages[{i}].tool_calls")
                if calls:
                    msg["tool_calls"] = []
                    for j, call in enumerate(calls):
                        args = _arguments(i, call)
                        name, cid = call["function"].get("name"), call.get("id")
                        if not isinstance(name, str) or not isinstance(cid, str):
                            raise ChatRenderError("a tool call needs a string 'id' and 'function.name'",
                                                  f"messages[{i}].tool_calls[{j}]")
                        # The keys and their order of OpenAI's typed dict, as vLLM's pydantic parse
                        # leaves them: a template's ``call | tojson`` then prints the same text.
                        fn = {"arguments": args, "name": name}
                        msg["tool_calls"].append({"id": cid, "function": {k: fn[k] for k in call_key_order},
                                                  "type": "function"})
            if m.get("reasoning") is not None:
                msg["reasoning"] = msg["reasoning_content"] = m["reasoning"]
        elif role == "tool" and "tool_call_id" in m:
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if isinstance(m.get("task"), str):
            msg["task"] = m["task"]
        if role == "developer":
            msg["tools"] = m.get("tools")
        conv.append(msg)
    if any(c["role"] == "developer" for c in conv) and '"developer"' not in template \
            and "'developer'" not in template:
        conv = _developer_to_system(conv)
    return conv


def _developer_to_system(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM: a template without a developer role gets those as system messages, merged into one first."""
    conv = [{**{k: v for k, v in c.items() if k != "tools"}, "role": "system"} if c["role"] == "developer" else c
            for c in conv]
    systems: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, c in enumerate(conv):
        if c["role"] != "system":
            rest.append(c)
            continue
        merge = merge or i > 0 or bool(systems)
        content = c.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] if isinstance(p, dict) and "text" in p else p
                                for p in content if isinstance(p, (dict, str)))
        if content:
            systems.append(content)
    return [{"role": "system", "content": "\n\n".join(systems)}, *rest] if merge else conv


# --------------------------------------------------------------------------- template keywords


@lru_cache(maxsize=32)
def template_variables(template: str) -> frozenset[str]:
    """The variables a template reads (what vLLM lets through of ``chat_template_kwargs``)."""
    import jinja2.ext
    import jinja2.meta
    import jinja2.sandbox

    class _Generation(jinja2.ext.Extension):   # transformers' {% generation %} tag, parsed only
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_g"), [], [], body).set_lineno(lineno)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[_Generation, jinja2.ext.loopcontrols])
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))


@lru_cache(maxsize=1)
def _hf_base_params() -> frozenset[str]:
    try:
        from transformers import PythonBackend as Base  # transformers 5, what vLLM 0.32 reads
    except ImportError:
        from transformers import PreTrainedTokenizerBase as Base

    sig = inspect.signature(Base.apply_chat_template)
    return frozenset(p.name for p in sig.parameters.values()
                     if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL))


def _merge(defaults: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``merge_kwargs``: an override of None or "auto" leaves the default."""
    return defaults | {k: v for k, v in overrides.items() if v is not None and v != "auto"}


# --------------------------------------------------------------------------- the renderer


class TemplateSource:
    """What of a Hugging Face tokenizer renders chat templates, read from a model directory.

    Loading ``AutoTokenizer`` costs ~10 CPU-seconds (imports and vocabulary) the router does not
    need: it encodes with the ``tokenizers`` library. This gives ``transformers``' own renderer
    (``render_jinja_template``) the same inputs ``PreTrainedTokenizerBase.apply_chat_template``
    gives it: the template chosen as ``get_chat_template`` chooses it, the named special tokens as
    variables under the caller's keywords."""

    SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        cfg = _json(path / "tokenizer_config.json")
        tpl: Any = cfg.get("chat_template")
        if isinstance(tpl, list):
            tpl = {t["name"]: t["template"] for t in tpl if isinstance(t, dict) and "name" in t}
        if tpl is None and (path / "chat_template.jinja").exists():
            tpl = (path / "chat_template.jinja").read_text(encoding="utf-8")
        if tpl is None and (path / "chat_template.json").exists():
            tpl = _json(path / "chat_template.json").get("chat_template")
        self.chat_template: str | dict[str, str] | None = tpl
        tokens = {**_json(path / "special_tokens_map.json"), **{k: v for k, v in cfg.items() if k in self.SPECIAL}}
        self.special_tokens_map = {k: str(v["content"] if isinstance(v, dict) else v)
                                   for k in self.SPECIAL if (v := tokens.get(k)) is not None}

    def get_chat_template(self, chat_template: str | None = None, tools: Any = None) -> str:
        named = self.chat_template if isinstance(self.chat_template, dict) else None
        if named is not None:
            if chat_template is not None and chat_template in named:
                return named[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in named:
                    return named["tool_use"]
                if "default" in named:
                    return named["default"]
                raise ValueError(f"several chat templates and no default: {sorted(named)}")
        if chat_template is None:
            if self.chat_template is None:
                raise ValueError("the tokenizer has no chat template")
            return self.chat_template  # type: ignore[return-value]
        return chat_template

    def apply_chat_template(self, conversation: list[dict[str, Any]], tools: Any = None, documents: Any = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = False,
                            return_dict: bool = False, **kwargs: Any) -> str:
        from transformers.utils.chat_template_utils import render_jinja_template

        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible")
        rendered, _ = render_jinja_template(
            conversations=[conversation], tools=tools, documents=documents,
            chat_template=self.get_chat_template(chat_template, tools), return_assistant_tokens_mask=False,
            continue_final_message=continue_final_message, add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **kwargs})
        return rendered[0]


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}



class ChatRenderer:
    """Renders chat requests for one model directory or a loaded HF tokenizer. Thread-safe.

    With a directory, templates come from a ``TemplateSource`` and ``encode`` must be given (the
    router passes its fast tokenizer's); with a HF tokenizer (the worker's), both come from it."""

    def __init__(self, model_dir: str | Path | None = None, *, hf_tokenizer: Any = None,
                 chat_template: str | None = None, encode: Callable[[str], list[int]] | None = None) -> None:
        if hf_tokenizer is None:
            if model_dir is None:
                raise ValueError("ChatRenderer needs a model directory or a loaded tokenizer")
            if encode is None:
                from kvmesh.tokenization.tokenizer import load_tokenizer

                fast = load_tokenizer(model_dir)
                encode = lambda text: fast.encode(text, add_special_tokens=False)  # noqa: E731
            self._encode_special: Callable[[str], list[int]] | None = None
            self.templates: Any = TemplateSource(model_dir)
        else:
            self.templates = hf_tokenizer
            self._encode_special = lambda text: list(hf_tokenizer.encode(text, add_special_tokens=True))
        self.model_dir = model_dir
        self.chat_template = chat_template
        self._encode = encode or (lambda text: list(hf_tokenizer.encode(text, add_special_tokens=False)))

    def template(self, tools: list[dict[str, Any]] | None) -> str:
        try:
            return self.templates.get_chat_template(self.chat_template, tools=tools)
        except ValueError as exc:
            raise ChatRenderError(f"the served model has no usable chat template: {exc}") from None

    def template_kwargs(self, req: ChatRequest, template: str) -> dict[str, Any]:
        """The keywords for ``apply_chat_template``, merged as vLLM merges them; unusable ones refused."""
        user = req.chat_template_kwargs
        reserved = sorted({"chat_template", "tokenize", "tools", "conversation", "messages"} & user.keys())
        if reserved:
            raise ChatRenderError(f"chat_template_kwargs may not set {', '.join(reserved)}",
                                  f"chat_template_kwargs.{reserved[0]}")
        accepted = template_variables(template) | _hf_base_params()
        unknown = sorted(k for k in user if k not in accepted)
        if unknown:
            raise ChatRenderError(f"chat_template_kwargs: the chat template does not use {', '.join(unknown)}",
                                  f"chat_template_kwargs.{unknown[0]}")
        kw = _merge(user, {"add_generation_prompt": req.add_generation_prompt,
                           "continue_final_message": req.continue_final_message, "documents": req.documents,
                           **req.engine_kwargs})
        return {k: v for k, v in kw.items() if k in accepted}

    def render_text(self, req: ChatRequest) -> str:
        """The prompt text vLLM makes of ``req``."""
        tpl = self.template(req.tools)
        conv = conversation(req.messages, detect_content_format(tpl), tpl, req.call_key_order)
        kw = self.template_kwargs(req, tpl)
        try:
            text = self.templates.apply_chat_template(conversation=conv, tools=req.tools, chat_template=tpl,
                                               tokenize=False, return_dict=False, **kw)
        except Exception as exc:  # jinja errors and the template's raise_exception
            raise ChatRenderError(f"the chat template rejected the request: {_reason(exc)}") from None
        return text

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if add_special_tokens:
            if self._encode_special is None:
                from kvmesh.tokenization.tokenizer import load_tokenizer

                return load_tokenizer(self.model_dir).encode(text, add_special_tokens=True)  # type: ignore[arg-type]
            return self._encode_special(text)
        return self._encode(text)

    def render_ids(self, req: ChatRequest) -> list[int]:
        """The prompt token ids vLLM makes of ``req``."""
        return self.encode(self.render_text(req), req.add_special_tokens)


def _reason(exc: BaseException) -> str:
    import jinja2

    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, jinja2.TemplateError):
            return str(cur)
        cur = cur.__cause__ or cur.__context__
    return str(exc)
