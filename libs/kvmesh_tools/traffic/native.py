"""The kvmesh-native trace format: jsonl, one session per line.

Why it exists: the generator needs a file format that keeps session structure
(sub-agents, think times) and can state that hash ids are shared across sessions
(a common system prompt), which neither Mooncake nor the per-file claude-code
format can. Schema of one line::

    {"session": "s0001",            # unique id
     "block_size": 64,              # tokens per hash id
     "hash_id_scope": "session",    # or "global": ids shared by all sessions of the file
     "start": 0.0,                  # optional recorded start offset (s)
     "requests": [                  # in order; times relative to the enclosing agent
        {"t": 0.0, "in": 20000, "out": 300, "hash_ids": [1, 2, ...],
         "think_time": 0.0, "api_time": 4.1, "model": "m"},      # a request
        {"type": "subagent", "t": 31.0, "agent_id": "a1", "duration": 40.0,
         "requests": [ ... ]}                                      # a sub-agent
     ]}

``in``/``out`` are token counts, ``hash_ids`` one id per full block of the input. A
sub-agent with ``"status": "async_launched"`` runs in the background: its parent never
waits for it.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from kvmesh_tools.traffic.model import Agent, Request, Session, Trace


def _items(agent: Agent, base_t: float) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for it in agent.items:
        if isinstance(it, Request):
            d: dict[str, Any] = {"t": round(it.t - base_t, 6), "in": it.input_tokens, "out": it.output_tokens,
                                 "hash_ids": it.hash_ids}
            if it.think_time is not None:
                d["think_time"] = round(it.think_time, 6)
            if it.api_time is not None:
                d["api_time"] = round(it.api_time, 6)
            if it.model:
                d["model"] = it.model
            out.append(d)
        else:
            sub_id = it.agent_id.rsplit("/", 1)[-1]
            d = {"type": "subagent", "t": round(it.t - base_t, 6), "agent_id": sub_id,
                 "requests": _items(it, it.t)}
            if it.duration is not None:
                d["duration"] = round(it.duration, 6)
            if it.detached:
                d["status"] = "async_launched"
            out.append(d)
    return out


def session_to_json(s: Session, hash_id_scope: str = "session") -> dict[str, Any]:
    return {"session": s.session_id, "block_size": s.block_size, "hash_id_scope": hash_id_scope,
            "start": s.start, "requests": _items(s.root, 0.0)}


def write_native(trace: Trace, path: str | Path, hash_id_scope: str = "session") -> Path:
    """Write ``trace`` as native jsonl (gzip when the name ends in .gz)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as fh:
        for s in trace.sessions:
            fh.write(json.dumps(session_to_json(s, hash_id_scope), separators=(",", ":")) + "\n")
    return path
