"""The OpenAI ``usage`` object, with ``prompt_tokens_details.cached_tokens``.

Why it exists: the prefix-cache hit is kvmesh's point, so every answer (and
the last chunk of a stream asked with ``include_usage``) reports how many
prompt tokens were served from cache in the field OpenAI clients read;
kvmesh-specific splits (GPU vs offload) go next to it as extra details.
"""

from __future__ import annotations

from typing import Any


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, **details: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens, **details}}
