"""Trace readers: claude-code ("weka", the kv-cache-tester format), Mooncake jsonl
and kvmesh-native jsonl, all into ``kvmesh_tools.traffic.model``.

Why it exists: every tool takes ``--trace PATHS --format F`` and must see the same
sessions; a malformed trace is a ``TraceFormatError`` naming the file, line and
field, never a crash deep inside the simulator.

Formats (see docs/traffic-and-simulation.md):
- ``weka`` / ``claude-code``: one session object per ``.json(.gz)`` file (the
  kv-cache-tester layout), or one per line of a ``.jsonl(.gz)`` file (the layout of
  the published cc-traces corpora), with nested sub-agents. A sub-agent's request
  times are relative to its ``t`` in the kv-cache-tester files and absolute (from
  the session's start) in the corpora; :func:`_nested_base` tells them apart.
  ``hash_id_scope`` ``local`` gives each session its own namespace, ``global`` one
  namespace shared by every session read.
- ``mooncake``: jsonl, one request per line ``{timestamp (ms), input_length,
  output_length, hash_ids}``, 512-token blocks, ids global to the file. Each line
  becomes a one-request session starting at its timestamp.
- ``native``: jsonl, one session per line (documented in ``kvmesh_tools.traffic.native``).
"""

from __future__ import annotations

import gzip
import io
import json
import math
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

from kvmesh_tools.traffic.model import Agent, Request, Session, Trace

FORMATS = ("weka", "claude-code", "mooncake", "native")
MOONCAKE_BLOCK_SIZE = 512


class TraceFormatError(ValueError):
    """A trace file is malformed; the message names the file, line and field."""


def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")  # noqa: SIM115


def expand_paths(paths: list[str | Path]) -> list[Path]:
    """Files as given; directories expand to their trace files, sorted by name."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files = sorted(f for f in p.iterdir() if f.is_file() and any(
                f.name.endswith(s) for s in (".json", ".json.gz", ".jsonl", ".jsonl.gz")))
            if not files:
                raise TraceFormatError(f"{p}: directory holds no .json/.jsonl(.gz) trace files")
            out.extend(files)
        elif p.is_file():
            out.append(p)
        else:
            raise TraceFormatError(f"{p}: no such trace file or directory")
    return out


def _req_field(obj: dict[str, Any], name: str, where: str, kind: type | tuple[type, ...]) -> Any:
    if name not in obj:
        raise TraceFormatError(f"{where}: missing field {name!r}")
    val = obj[name]
    if isinstance(val, bool) or not isinstance(val, kind):
        raise TraceFormatError(f"{where}: field {name!r} has type {type(val).__name__}")
    return val


def _hash_ids(obj: dict[str, Any], where: str) -> list[int]:
    ids = _req_field(obj, "hash_ids", where, list)
    # By exact type, in C: a bool is not an id, and a trace holds millions of them.
    if ids and set(map(type, ids)) != {int}:
        raise TraceFormatError(f"{where}: field 'hash_ids' must be a list of integers")
    return ids


def _parse_items(items: list[Any], *, session: str, agent: str, base_t: float, namespace: str,
                 block_size: int, where: str, counter: list[int], tell_clock: bool = False) -> list[Request | Agent]:
    """Parse a claude-code / native ``requests`` list; times become session-absolute.

    ``tell_clock``: sub-agent times may be on the session's clock (claude-code corpora,
    :func:`_nested_base`); native files always count them from the sub-agent's ``t``."""
    out: list[Request | Agent] = []
    for i, it in enumerate(items):
        w = f"{where} requests[{i}]"
        if not isinstance(it, dict):
            raise TraceFormatError(f"{w}: expected an object")
        t_rel = float(_req_field(it, "t", w, (int, float)))
        if not math.isfinite(t_rel) or t_rel < 0:
            raise TraceFormatError(f"{w}: field 't' must be a finite time >= 0")
        if it.get("type") == "subagent":
            sub_id = str(it.get("agent_id") or f"sub{i}")
            full_id = sub_id if agent == "main" else f"{agent}/{sub_id}"
            dur_ms = it.get("duration_ms")
            dur = float(it["duration"]) if "duration" in it else (float(dur_ms) / 1000.0 if dur_ms else None)
            sub = Agent(agent_id=full_id, t=base_t + t_rel, duration=dur, kind=str(it.get("subagent_type", "")),
                        detached=it.get("status") == "async_launched")
            inner = _req_field(it, "requests", w, list)
            inner_base = _nested_base(inner, base_t, t_rel) if tell_clock else base_t + t_rel
            sub.items = _parse_items(inner, session=session, agent=full_id, base_t=inner_base,
                                     namespace=namespace, block_size=block_size,
                                     where=f"{w} (subagent {sub_id})", counter=counter, tell_clock=tell_clock)
            out.append(sub)
            continue
        n_in = _req_field(it, "in", w, int)
        n_out = _req_field(it, "out", w, int)
        if n_in < 0 or n_out < 0:
            raise TraceFormatError(f"{w}: negative token count")
        ids = _hash_ids(it, w)
        if len(ids) * block_size > n_in + block_size:
            raise TraceFormatError(f"{w}: {len(ids)} hash ids of {block_size} tokens exceed in={n_in}")
        counter[0] += 1
        out.append(Request(
            uid=f"{session}/{agent}/{counter[0]}", session=session, agent=agent, t=base_t + t_rel,
            input_tokens=n_in, output_tokens=n_out, hash_ids=ids, namespace=namespace,
            block_size=block_size,
            think_time=float(it["think_time"]) if it.get("think_time") is not None else None,
            api_time=float(it["api_time"]) if it.get("api_time") is not None else None,
            model=str(it.get("model", ""))))
    return out


def _nested_base(inner: list[Any], base_t: float, t_rel: float) -> float:
    """The time a sub-agent's request times count from, session-absolute.

    kv-cache-tester's files time a sub-agent's requests from its spawn (its first request
    at 0), the cc-traces corpora from the start of the session: every inner time is at or
    after the sub-agent's own ``t``. So times that all reach the spawn are read as the
    parent's clock; otherwise they count from the spawn. A spawn at 0 reads the same
    either way, and where the first relative request comes only after the parent's whole
    elapsed time, the reading is off by at most that first request's delay.
    """
    times = [it.get("t") for it in inner if isinstance(it, dict)]
    if t_rel > 0 and times and all(isinstance(t, (int, float)) and not isinstance(t, bool) and t >= t_rel
                                   for t in times):
        return base_t
    return base_t + t_rel


_SCOPES = ("local", "global")


def _claude_code_session(doc: Any, where: str, default_id: str) -> Session:
    """One claude-code session object (a file's document, or a corpus line)."""
    if not isinstance(doc, dict):
        raise TraceFormatError(f"{where}: expected a JSON object")
    block_size = int(_req_field(doc, "block_size", where, int))
    if block_size <= 0:
        raise TraceFormatError(f"{where}: block_size must be positive")
    scope = doc.get("hash_id_scope", "local")
    if scope not in _SCOPES:
        raise TraceFormatError(f"{where}: hash_id_scope must be 'local' or 'global', got {scope!r}")
    sid = str(doc.get("id") or default_id)
    root = Agent(agent_id="main", t=0.0)
    # Local ids: the session id is the namespace (load_trace renames a repeated id, and the
    # namespace with it). Global ids: one namespace for every session read.
    namespace = "cc-global" if scope == "global" else f"cc:{sid}"
    root.items = _parse_items(_req_field(doc, "requests", where, list), session=sid, agent="main", base_t=0.0,
                              namespace=namespace, block_size=block_size, where=where, counter=[0],
                              tell_clock=True)
    return Session(session_id=sid, root=root, block_size=block_size, source=where)


def _load_json_file(path: Path) -> Any:
    try:
        with _open_text(path) as fh:
            return json.load(fh)
    except (OSError, EOFError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TraceFormatError(f"{path}: not a JSON document: {exc}") from exc


def read_claude_code(path: str | Path) -> Session:
    """One claude-code session file (``.json`` or ``.json.gz``)."""
    path = Path(path)
    return _claude_code_session(_load_json_file(path), str(path), path.name.split(".")[0])


def read_claude_code_corpus(path: str | Path) -> Iterator[Session]:
    """A claude-code corpus (``.jsonl`` or ``.jsonl.gz``): one session object per line, read as
    they are asked for (a published corpus is hundreds of MB; ``--limit-sessions`` reads its head)."""
    path = Path(path)
    for lineno, obj in _iter_jsonl(path):
        yield _claude_code_session(obj, f"{path}:{lineno}", f"{path.name.split('.')[0]}-{lineno}")


def _iter_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    try:
        with _open_text(path) as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TraceFormatError(f"{path}:{lineno}: invalid JSON: {exc}") from exc
                if not isinstance(obj, dict):
                    raise TraceFormatError(f"{path}:{lineno}: expected a JSON object")
                yield lineno, obj
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise TraceFormatError(f"{path}: cannot read: {exc}") from exc


def read_mooncake(path: str | Path, block_size: int = MOONCAKE_BLOCK_SIZE) -> list[Session]:
    """Mooncake jsonl: each line is an independent request, arriving at its timestamp."""
    path = Path(path)
    namespace = f"mc:{path.name}"
    out: list[Session] = []
    for lineno, obj in _iter_jsonl(path):
        w = f"{path}:{lineno}"
        ts = float(_req_field(obj, "timestamp", w, (int, float))) / 1000.0
        n_in = _req_field(obj, "input_length", w, int)
        n_out = _req_field(obj, "output_length", w, int)
        ids = _hash_ids(obj, w)
        sid = f"mc{lineno}"
        req = Request(uid=f"{sid}/main/1", session=sid, agent="main", t=0.0, input_tokens=n_in,
                      output_tokens=n_out, hash_ids=ids, namespace=namespace, block_size=block_size)
        out.append(Session(session_id=sid, root=Agent("main", 0.0, [req]), block_size=block_size,
                           start=ts, source=str(path)))
    return out


def read_native(path: str | Path) -> list[Session]:
    """kvmesh-native jsonl (see ``kvmesh_tools.traffic.native`` for the schema)."""
    path = Path(path)
    out: list[Session] = []
    seen: set[str] = set()
    for lineno, obj in _iter_jsonl(path):
        w = f"{path}:{lineno}"
        sid = str(_req_field(obj, "session", w, (str, int)))
        if sid in seen:
            raise TraceFormatError(f"{w}: duplicate session id {sid!r}")
        seen.add(sid)
        block_size = int(_req_field(obj, "block_size", w, int))
        if block_size <= 0:
            raise TraceFormatError(f"{w}: block_size must be positive")
        scope = obj.get("hash_id_scope", "session")
        if scope not in ("session", "global"):
            raise TraceFormatError(f"{w}: hash_id_scope must be 'session' or 'global', got {scope!r}")
        namespace = f"nat:{path.name}" if scope == "global" else f"nat:{path.name}:{sid}"
        root = Agent("main", 0.0)
        root.items = _parse_items(_req_field(obj, "requests", w, list), session=sid, agent="main", base_t=0.0,
                                  namespace=namespace, block_size=block_size, where=w, counter=[0])
        out.append(Session(session_id=sid, root=root, block_size=block_size,
                           start=float(obj.get("start", 0.0)), source=str(path)))
    return out


def _rename(s: Session, new_id: str) -> None:
    """Give a session a new id (and so a new hash-id namespace for file-local ids)."""
    for r in s.requests():
        if r.namespace.endswith(f":{s.session_id}"):
            r.namespace = r.namespace[: -len(s.session_id)] + new_id
        r.uid = new_id + r.uid[len(s.session_id):]
        r.session = new_id
        r._keys = None
    s.session_id = new_id


def load_trace(paths: list[str | Path], fmt: str = "weka", limit: int | None = None) -> Trace:
    """Read every path (files or directories) in ``fmt``; ``limit`` keeps the first N sessions."""
    if fmt not in FORMATS:
        raise TraceFormatError(f"unknown trace format {fmt!r}; expected one of {', '.join(FORMATS)}")
    sessions: list[Session] = []
    for p in expand_paths(paths):
        if fmt in ("weka", "claude-code"):
            if p.name.endswith((".jsonl", ".jsonl.gz")):
                sessions.extend(islice(read_claude_code_corpus(p),
                                       None if limit is None else max(0, limit - len(sessions))))
            else:
                sessions.append(read_claude_code(p))
        elif fmt == "mooncake":
            sessions.extend(read_mooncake(p))
        else:
            sessions.extend(read_native(p))
        if limit is not None and len(sessions) >= limit:
            sessions = sessions[:limit]
            break
    if not sessions:
        raise TraceFormatError("the trace holds no sessions")
    sizes = {s.block_size for s in sessions}
    if len(sizes) > 1:
        raise TraceFormatError(f"sessions disagree on block size: {sorted(sizes)}")
    ids = [s.session_id for s in sessions]
    if len(set(ids)) != len(ids):
        # Two files with the same id would share a namespace; keep them apart.
        for i, s in enumerate(sessions):
            _rename(s, f"{i}:{s.session_id}")
    return Trace(sessions=sessions, fmt=fmt, block_size=sizes.pop())
