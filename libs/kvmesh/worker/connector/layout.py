"""Store namespace of a vLLM engine's KV bytes.

Why separate from ``kvmesh.kvstore.layout.namespace_for``: the connector ships
vLLM's paged-cache bytes verbatim, whose order depends on the attention backend
(CPU: ``[blocks, kv_heads, block_size, 2*head]``; CUDA flash: ``[2, blocks, ...]``).
A suffix naming the byte layout keeps a CPU engine from restoring a CUDA
engine's blocks (or the simulator's filler bytes): a different layout is a miss.

With tensor or pipeline parallelism every rank holds a different slice (heads,
layers) of the same block under the same block hash, so each rank gets its own
namespace; a single-rank engine keeps the plain one.
"""

from __future__ import annotations

from kvmesh.kvstore.layout import namespace_for

LAYOUT_TAG = "vllm-paged"


def connector_namespace(model: str, num_layers: int, num_kv_heads: int, head_dim: int, dtype: object,
                        block_size: int, device: str = "cpu") -> str:
    return f"{namespace_for(model, num_layers, num_kv_heads, head_dim, dtype, block_size)}/{LAYOUT_TAG}-{device}"


def rank_namespace(base: str, tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1) -> str:
    """The namespace of one TP/PP rank's slice; ``base`` itself for a single-rank engine."""
    if tp_size < 1 or pp_size < 1 or not 0 <= tp_rank < tp_size or not 0 <= pp_rank < pp_size:
        raise ValueError(f"bad rank tp {tp_rank}/{tp_size} pp {pp_rank}/{pp_size}")
    if tp_size * pp_size == 1:
        return base
    return f"{base}/tp{tp_rank}of{tp_size}-pp{pp_rank}of{pp_size}"


def all_rank_namespaces(base: str, tp_size: int, pp_size: int = 1) -> list[str]:
    """Every rank's namespace: a block is restorable only when all of them hold it."""
    return [rank_namespace(base, t, tp_size, p, pp_size) for p in range(pp_size) for t in range(tp_size)]
