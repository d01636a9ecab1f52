"""The moved-turn figures every tool reports alike (``kvmesh.routing.moves``).

The simulator and ``kvmesh replay`` (so ``kvmesh demo``) both report, per run, the turns routed
away from their session's previous endpoint: how many, their share of the prompt tokens, what they
reused, and what their previous endpoints were predicted to hold beyond their new ones. One
function computes them so that a simulated and a live run are read with the same keys.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def moved_metrics(moved: Iterable[tuple[int, int, int]], prompt_tokens: int) -> dict[str, Any]:
    """From the moved turns' ``(prompt tokens, reused tokens, given-up tokens)`` and every turn's
    prompt tokens: ``moved_requests``, ``moved_prompt_share``, ``moved_hit_rate`` (over the moved
    turns' prompts) and ``moved_given_up_share`` (over all prompt tokens)."""
    n = mp = reused = given_up = 0
    for p, r, g in moved:
        n, mp, reused, given_up = n + 1, mp + p, reused + r, given_up + g
    return {"moved_requests": n,
            "moved_prompt_share": round(mp / prompt_tokens, 4) if prompt_tokens else 0.0,
            "moved_hit_rate": round(reused / mp, 4) if mp else 0.0,
            "moved_given_up_share": round(given_up / prompt_tokens, 4) if prompt_tokens else 0.0}
