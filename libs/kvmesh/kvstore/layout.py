"""KV layout naming and sizing shared by every producer and consumer of offloaded KV.

Two engines may only exchange KV blocks when their layouts agree exactly (model,
layer count, KV heads, head size, dtype and block size). The store does not
interpret bytes, so the layout is folded into the *namespace*: a consumer with a
different layout asks under a different namespace and simply misses, instead of
restoring bytes it would misread.
"""

from __future__ import annotations

import re

# Accepts vLLM/torch spellings ("torch.bfloat16", "bfloat16", "bf16", "half", ...).
_DTYPE_BYTES: dict[str, tuple[str, int]] = {
    "bfloat16": ("bf16", 2), "bf16": ("bf16", 2),
    "float16": ("fp16", 2), "fp16": ("fp16", 2), "half": ("fp16", 2),
    "float32": ("fp32", 4), "fp32": ("fp32", 4), "float": ("fp32", 4),
    "float8_e4m3fn": ("fp8e4m3", 1), "fp8_e4m3": ("fp8e4m3", 1), "fp8": ("fp8", 1),
    "float8_e5m2": ("fp8e5m2", 1), "fp8_e5m2": ("fp8e5m2", 1),
    "int8": ("int8", 1), "uint8": ("uint8", 1),
}

_MODEL_SAFE = re.compile(r"[^A-Za-z0-9._\-/]+")


def _dtype(dtype: object) -> tuple[str, int]:
    name = str(dtype).strip().lower()
    if name.startswith("torch."):
        name = name[len("torch."):]
    try:
        return _DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"unknown KV dtype {dtype!r}; known: {sorted(_DTYPE_BYTES)}") from None


def dtype_bytes(dtype: object) -> int:
    """Bytes per element of a KV dtype (``"bf16"``, ``"torch.float16"``, ...)."""
    return _dtype(dtype)[1]


def _positive(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: object) -> int:
    """Bytes of K and V for one token: 2 x layers x kv_heads x head_dim x dtype bytes."""
    return (2 * _positive("num_layers", num_layers) * _positive("num_kv_heads", num_kv_heads)
            * _positive("head_dim", head_dim) * dtype_bytes(dtype))


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, dtype: object, block_size: int) -> int:
    """Bytes of one full KV block of ``block_size`` tokens."""
    return kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype) * _positive("block_size", block_size)


def namespace_for(model: str, num_layers: int, num_kv_heads: int, head_dim: int, dtype: object,
                  block_size: int) -> str:
    """The store namespace for a model and its KV layout, e.g. ``tiny-llama/L2-H2-D32-bf16-bs32``."""
    if not model or not str(model).strip():
        raise ValueError("model must be a non-empty string")
    short, _ = _dtype(dtype)
    safe_model = _MODEL_SAFE.sub("_", str(model).strip())
    return (f"{safe_model}/L{_positive('num_layers', num_layers)}-H{_positive('num_kv_heads', num_kv_heads)}"
            f"-D{_positive('head_dim', head_dim)}-{short}-bs{_positive('block_size', block_size)}")
