"""Store namespace of a vLLM engine's KV bytes.

Why separate from ``kvmesh.kvstore.layout.namespace_for``: the connector ships
vLLM's paged-cache bytes verbatim, whose order depends on the attention backend
(CPU: ``[blocks, kv_heads, block_size, 2*head]``; CUDA flash: ``[2, blocks, ...]``).
A suffix naming the byte layout keeps a CPU engine from restoring a CUDA
engine's blocks (or the simulator's filler bytes): a different layout is a miss.
"""

from __future__ import annotations

from kvmesh.kvstore.layout import namespace_for

LAYOUT_TAG = "vllm-paged"


def connector_namespace(model: str, num_layers: int, num_kv_heads: int, head_dim: int, dtype: object,
                        block_size: int, device: str = "cpu") -> str:
    return f"{namespace_for(model, num_layers, num_kv_heads, head_dim, dtype, block_size)}/{LAYOUT_TAG}-{device}"
