"""Does a chat template read message content as a string or as a list of parts?

Why it exists: vLLM's OpenAI server hands a template either ``content`` joined to one
string (text parts joined with "\\n") or the list of ``{"type": "text", ...}`` parts,
depending on whether the template loops over the content ("openai" format) or not
("string"). It decides by walking the template's Jinja AST. kvmesh must decide the
same way to render the same prompt, and the router must not depend on vLLM, so this
is a port of vLLM 0.32's detector (``vllm/renderers/hf.py``: ``_detect_content_format``
and the ``_iter_nodes_*`` helpers, Apache-2.0). The vLLM-tier contract test checks that
it agrees with vLLM's own on the templates we test with.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from functools import lru_cache
from typing import Literal

import jinja2.nodes as jn

ContentFormat = Literal["string", "openai"]


def _is_var(node: jn.Node, name: str) -> bool:
    return isinstance(node, jn.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: jn.Node, name: str, key: str) -> bool:
    if isinstance(node, jn.Getitem):
        return _is_var(node.node, name) and isinstance(node.arg, jn.Const) and node.arg.value == key
    if isinstance(node, jn.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_var_or_elems(node: jn.Node, name: str, key: str | None = None) -> bool:
    if isinstance(node, jn.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, jn.Test):
        return _is_var_or_elems(node.node, name, key)
    if isinstance(node, jn.Getitem) and isinstance(node.arg, jn.Slice):
        return _is_var_or_elems(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _aliases(root: jn.Node, name: str) -> Iterator[str]:
    """``name`` and every variable assigned from it (or its elements), transitively."""
    yield name
    todo = deque([name])
    while todo:
        cur = todo.popleft()
        for assign in root.find_all(jn.Assign):
            if _is_var_or_elems(assign.node, cur) and isinstance(assign.target, jn.Name):
                yield assign.target.name
                if assign.target.name != cur:
                    todo.append(assign.target.name)


def _message_vars(root: jn.Node) -> Iterator[str]:
    """Loop variables of ``{% for message in messages %}`` loops (through aliases of ``messages``)."""
    names = list(_aliases(root, "messages"))
    for loop in root.find_all(jn.For):
        if any(_is_var_or_elems(loop.iter, n) for n in names) and isinstance(loop.target, jn.Name):
            yield loop.target.name


def _content_loops(root: jn.Node) -> Iterator[jn.For]:
    """Loops over a message's content, directly or through a macro parameter bound to it."""
    msg_vars = list(_message_vars(root))

    def is_content(node: jn.Node) -> bool:
        return any(_is_var_or_elems(node, v, "content") for v in msg_vars)

    macro_params_by_loop: dict[int, set[str]] = {}
    loops_in_macros: set[int] = set()
    for macro in root.find_all(jn.Macro):
        names = {a.name for a in macro.args}
        params: set[str] = set()
        for call in root.find_all(jn.Call):
            if isinstance(call.node, jn.Name) and call.node.name == macro.name:
                params |= {macro.args[i].name for i, a in enumerate(call.args)
                           if i < len(macro.args) and is_content(a)}
                params |= {k.key for k in call.kwargs
                           if isinstance(k, jn.Keyword) and k.key in names and is_content(k.value)}
        for loop in macro.find_all(jn.For):
            loops_in_macros.add(id(loop))
            if params:
                macro_params_by_loop[id(loop)] = params
    for loop in root.find_all(jn.For):
        if is_content(loop.iter):
            yield loop
            continue
        params = macro_params_by_loop.get(id(loop))
        if isinstance(loop.iter, jn.Name):
            if params is not None and loop.iter.name in params:
                yield loop
            elif id(loop) not in loops_in_macros and loop.iter.name == "content":
                yield loop


@lru_cache(maxsize=32)
def detect_content_format(template: str) -> ContentFormat:
    """vLLM's ``auto`` content format for ``template`` ("string" when it cannot parse it)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        ast = _compile_jinja_template(template).environment.parse(template)
    except Exception:  # an unparsable template: vLLM falls back to its default, "string"
        return "string"
    try:
        next(_content_loops(ast))
    except StopIteration:
        return "string"
    except Exception:
        return "string"
    return "openai"
