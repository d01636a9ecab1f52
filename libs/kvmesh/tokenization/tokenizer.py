"""Tokenize prompts and chat conversations exactly as the served model would.

Why it exists: the router must hash the *same* token ids the engine will see,
so it tokenizes with the model's own HF tokenizer and chat template. This
wrapper loads a model directory once and offers the three operations the
router needs (encode text, render + encode a chat, decode), with the fast
Rust ``tokenizers`` path when ``tokenizer.json`` exists (no ``transformers``
import on the hot path) and ``transformers.AutoTokenizer`` as the fallback for
other tokenizer formats.

Chat is rendered by ``kvmesh.tokenization.chat_render`` (vLLM's conversation rules,
``transformers``' ``apply_chat_template``), loaded on first use; the rendered text is
encoded here with the fast path, which gives the same ids as the HF tokenizer.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.tokenization.chat_render import ChatRenderer, ChatRenderError, ChatRequest, chat_request_from_body

logger = logging.getLogger(__name__)


class TokenizerError(ValueError):
    """The tokenizer directory or a chat request is unusable; the message says why, ``param`` names the
    request field at fault."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class TokenizerInfo:
    path: str
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    has_chat_template: bool


class ChatTokenizer:
    """A model directory's tokenizer plus its chat template. Thread-safe for reads."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise TokenizerError(f"tokenizer path {self.path} is not a directory")
        cfg_file = self.path / "tokenizer_config.json"
        self._cfg: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        self._fast = None
        self._hf = None
        self._lock = threading.Lock()
        self._renderer: ChatRenderer | None = None
        tj = self.path / "tokenizer.json"
        if tj.exists():
            from tokenizers import Tokenizer

            self._fast = Tokenizer.from_file(str(tj))
        else:
            try:
                from transformers import AutoTokenizer

                self._hf = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
            except Exception as exc:  # transformers raises many types here
                raise TokenizerError(f"cannot load a tokenizer from {self.path}: {exc}") from exc
        self.chat_template: str | None = self._load_template()
        self.bos_token = self._token_str("bos_token")
        self.eos_token = self._token_str("eos_token")
        self.bos_token_id = self.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self.token_to_id(self.eos_token) if self.eos_token else None
        self.add_bos = bool(self._cfg.get("add_bos_token", False))

    # ------------------------------------------------------------------ facts

    def _token_str(self, key: str) -> str | None:
        v = self._cfg.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        if v is None and self._hf is not None:
            v = getattr(self._hf, key, None)
        return v

    def _load_template(self) -> str | None:
        tpl = self._cfg.get("chat_template")
        if isinstance(tpl, list):  # HF allows named templates; use "default"
            named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
            tpl = named.get("default") or next(iter(named.values()), None)
        if not tpl and (self.path / "chat_template.jinja").exists():
            tpl = (self.path / "chat_template.jinja").read_text()
        if not tpl and self._hf is not None:
            tpl = getattr(self._hf, "chat_template", None)
        return tpl or None

    @property
    def vocab_size(self) -> int:
        if self._fast is not None:
            return self._fast.get_vocab_size(with_added_tokens=True)
        return len(self._hf)

    def token_to_id(self, token: str) -> int | None:
        if self._fast is not None:
            return self._fast.token_to_id(token)
        tid = self._hf.convert_tokens_to_ids(token)
        return tid if isinstance(tid, int) else None

    def info(self) -> TokenizerInfo:
        return TokenizerInfo(str(self.path), self.vocab_size, self.bos_token_id, self.eos_token_id,
                             self.chat_template is not None)

    # ------------------------------------------------------------------ operations

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special-token strings inside ``text`` map to their ids."""
        if not isinstance(text, str):
            raise TokenizerError(f"prompt must be a string, got {type(text).__name__}")
        if self._fast is not None:
            ids = self._fast.encode(text, add_special_tokens=add_special_tokens).ids
            if add_special_tokens and self.add_bos and self.bos_token_id is not None:
                ids = [self.bos_token_id, *ids]
            return ids
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """Token ids of ``text`` (no special tokens added) and each token's start character."""
        if self._fast is not None:
            enc = self._fast.encode(text, add_special_tokens=False)
            return enc.ids, [s for s, _ in enc.offsets]
        enc = self._hf(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [s for s, _ in enc["offset_mapping"]]

    def encode_with_offsets_batch(self, texts: list[str]) -> list[tuple[list[int], list[int]]] | None:
        """``encode_with_offsets`` of each text, run on the ``tokenizers`` thread pool without the GIL;
        None without the fast tokenizer."""
        if self._fast is None:
            return None
        return [(e.ids, [s for s, _ in e.offsets]) for e in self._fast.encode_batch(texts, add_special_tokens=False)]

    @property
    def has_fast(self) -> bool:
        return self._fast is not None

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self._fast is not None:
            return [e.ids for e in self._fast.encode_batch(list(texts), add_special_tokens=False)]
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._fast is not None:
            return self._fast.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def renderer(self) -> ChatRenderer:
        """The chat renderer of this model directory (loads ``transformers``' tokenizer once)."""
        if self._renderer is None:
            with self._lock:
                if self._renderer is None:
                    self._renderer = ChatRenderer(self.path, hf_tokenizer=self._hf,
                                                  encode=lambda text: self.encode(text, add_special_tokens=False))
                    if self._hf is None:   # the renderer must encode special tokens as this tokenizer does
                        self._renderer._encode_special = lambda text: self.encode(text, add_special_tokens=True)
        return self._renderer

    def render(self, req: ChatRequest) -> str:
        """The prompt text vLLM makes of a chat request; ``TokenizerError`` (with ``param``) if it cannot."""
        if not self.chat_template:
            raise TokenizerError(f"the tokenizer at {self.path} has no chat template")
        try:
            return self.renderer.render_text(req)
        except ChatRenderError as exc:
            raise TokenizerError(exc.message, exc.param) from None

    def render_chat(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text the chat template makes of ``messages`` (as vLLM renders it)."""
        body: dict[str, Any] = {"messages": messages, "tools": list(tools) if tools else None,
                                "add_generation_prompt": add_generation_prompt}
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        try:
            req = chat_request_from_body(body)
        except ChatRenderError as exc:
            raise TokenizerError(exc.message, exc.param) from None
        return self.render(req)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                            tools: Sequence[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        """Token ids of the rendered chat (the template adds BOS itself, as HF does)."""
        text = self.render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)


_CACHE: dict[str, ChatTokenizer] = {}
_CACHE_LOCK = threading.Lock()


def load_tokenizer(path: str | Path) -> ChatTokenizer:
    """Load (once per process) the tokenizer of the model directory ``path``."""
    key = str(Path(path).resolve())
    with _CACHE_LOCK:
        tok = _CACHE.get(key)
        if tok is None:
            tok = ChatTokenizer(key)
            _CACHE[key] = tok
            logger.info("tokenizer loaded", extra={"path": key, "vocab_size": tok.vocab_size})
        return tok
