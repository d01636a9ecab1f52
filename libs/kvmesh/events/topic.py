"""kvmesh's ZMQ topic convention for KV events: ``kv@<endpoint_id>@<model>``.

vLLM publishes whatever topic it is configured with; kvmesh engines are configured with
this one so a subscriber sharing one socket across engines can attribute every message.
"""

from __future__ import annotations

PREFIX = "kv"
SEP = "@"


def make_topic(endpoint_id: str, model: str) -> str:
    if not endpoint_id or SEP in endpoint_id:
        raise ValueError(f"endpoint id must be non-empty and contain no {SEP!r}: {endpoint_id!r}")
    if not model:
        raise ValueError("model must be non-empty")
    return f"{PREFIX}{SEP}{endpoint_id}{SEP}{model}"


def parse_topic(topic: str | bytes) -> tuple[str, str]:
    """(endpoint_id, model); ValueError for a topic not made by :func:`make_topic`."""
    if isinstance(topic, bytes):
        try:
            topic = topic.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("topic is not UTF-8") from None
    parts = topic.split(SEP, 2)
    if len(parts) != 3 or parts[0] != PREFIX or not parts[1] or not parts[2]:
        raise ValueError(f"not a kvmesh topic (want kv@<endpoint>@<model>): {topic!r}")
    return parts[1], parts[2]


DP_SUFFIX = "_dp"


def dp_endpoint(endpoint_id: str, rank: int) -> str:
    """The id of data-parallel rank ``rank`` of an engine (rank 0: the engine's own id).

    Every DP rank of a vLLM publishes the same topic; the indexer tells them apart by the
    port each connects to and names rank r ``<id>_dp<r>`` (vLLM's own suffix for per-rank
    endpoints); the router gives the same ids to the ranks of an external server."""
    return endpoint_id if rank == 0 else f"{endpoint_id}{DP_SUFFIX}{rank}"
