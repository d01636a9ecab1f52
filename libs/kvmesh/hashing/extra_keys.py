"""Per-block extra hash keys (LoRA, multimodal, cache_salt), built as vLLM 0.32 builds them.

vLLM mixes request metadata into each block hash as a tuple of tagged keys, in the order
``("lora", name, path)``, ``("mm", identifier, offset_in_block)``..., ``("cache_salt", salt)``
(first block only). Getting that order or the first-block rule wrong silently breaks
prefix matching, so it lives in one place, mirrored line by line from
``vllm/v1/core/kv_cache_utils.py:generate_block_hash_extra_keys``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class MMRange:
    """One multimodal placeholder range: its content hash and token span."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """Request metadata that vLLM folds into block hashes.

    ``mm`` must be sorted by offset and non-overlapping, as vLLM assumes.
    Prompt-embeds keys are not supported (kvmesh routes token prompts only).
    """

    cache_salt: str | None = None
    lora_name: str | None = None
    lora_path: str | None = None
    mm: tuple[MMRange, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.lora_path is not None and self.lora_name is None:
            raise ValueError("lora_path given without lora_name")
        if not isinstance(self.mm, tuple):
            object.__setattr__(self, "mm", tuple(self.mm))
        prev_end = None
        for r in self.mm:
            if not isinstance(r, MMRange):
                raise TypeError(f"mm entries must be MMRange, got {type(r).__name__}")
            if r.length <= 0 or r.offset < 0:
                raise ValueError(f"invalid mm range {r}")
            if prev_end is not None and r.offset < prev_end:
                raise ValueError("mm ranges must be sorted by offset and non-overlapping")
            prev_end = r.offset + r.length

    @property
    def is_empty(self) -> bool:
        return not (self.cache_salt or self.lora_name or self.mm)

    def lora_keys(self) -> list[tuple[str, str, str]]:
        if not self.lora_name:
            # vLLM checks the LoRARequest object, which always has a name; an empty
            # name is treated as "no LoRA" here.
            return []
        # vLLM's LoRARequest.lora_path is a str (it requires a non-empty one); a caller
        # that only knows the name gets "" rather than None, so at least the type matches.
        return [("lora", self.lora_name, self.lora_path if self.lora_path is not None else "")]


def mm_start_index(mm: tuple[MMRange, ...], start_token_idx: int, block_size: int) -> int:
    """The mm cursor vLLM uses when it resumes hashing at ``start_token_idx``."""
    if start_token_idx <= 0 or not mm:
        return 0
    last = mm[-1]
    if last.offset + last.length <= start_token_idx:
        return 0
    ends = [r.offset + r.length for r in mm]
    return bisect.bisect_left(ends, start_token_idx + 1)


def mm_keys_for_block(
    mm: tuple[MMRange, ...], start: int, end: int, start_idx: int
) -> tuple[list[tuple[str, str, int]], int]:
    """``_gen_mm_extra_hash_keys``: mm keys of block [start, end) and the next cursor."""
    keys: list[tuple[str, str, int]] = []
    if not mm:
        return keys, start_idx
    last = mm[-1]
    if last.offset + last.length <= start:
        return keys, start_idx
    if start_idx < 0:
        start_idx = len(mm) + start_idx
    idx = start_idx
    while idx < len(mm):
        r = mm[idx]
        if end > r.offset:
            if start >= r.offset + r.length:
                idx += 1
                continue
            keys.append(("mm", r.identifier, r.offset - start))
            if end >= r.offset + r.length:
                idx += 1
            else:
                break
        else:
            break
    return keys, idx


def block_extra_keys(
    extra: ExtraKeys | None, start: int, end: int, mm_idx: int
) -> tuple[tuple[Any, ...] | None, int]:
    """``generate_block_hash_extra_keys`` for block [start, end): (keys or None, next mm cursor)."""
    if extra is None:
        return None, mm_idx
    mm_keys, mm_idx = mm_keys_for_block(extra.mm, start, end, mm_idx)
    keys: list[Any] = extra.lora_keys() + mm_keys
    if start == 0 and extra.cache_salt:
        keys.append(("cache_salt", extra.cache_salt))
    if not keys:
        return None, mm_idx
    return tuple(keys), mm_idx


def to_event_extra_keys(keys: tuple[tuple[Any, ...], ...] | None) -> tuple[Any, ...] | None:
    """The untagged per-block form vLLM publishes in ``BlockStored.extra_keys``."""
    if keys is None:
        return None
    return tuple(k[1:] if k[0] == "mm" else k[1] for k in keys)
