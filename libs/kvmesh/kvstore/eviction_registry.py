"""The eviction policies by name: the one table of them, and the function that builds one.

Why it exists: the offload store, the cluster simulator and the policy bench
pick an eviction policy by name (``--eviction-policy``, ``--offload-eviction``).
Each name is its class's ``name``; the class is imported on first use. Adding a
policy: write its class (in ``kvmesh.kvstore.eviction`` or a module of its own),
add one line here.
"""

from __future__ import annotations

from typing import Any

from kvmesh.registry import LazyRegistry

EVICTION_POLICIES: LazyRegistry[Any] = LazyRegistry("eviction policy", {
    # "agent" is the depth-discounted LRU (the default); "greedy-dual" the GreedyDual priority.
    "agent": ("kvmesh.kvstore.eviction", "DepthDiscountedPolicy"),
    "greedy-dual": ("kvmesh.kvstore.eviction", "GreedyDualPolicy"),
    "lru": ("kvmesh.kvstore.eviction", "LRUPolicy"),
    "session-rate": ("kvmesh.kvstore.eviction", "SessionRatePolicy"),
})


def eviction_policy_names() -> list[str]:
    return EVICTION_POLICIES.names()


def make_eviction_policy(name: str, **kwargs: Any) -> Any:  # -> kvmesh.kvstore.eviction.EvictionPolicy
    """A new policy ``name``; ``ValueError`` names the choices for an unknown name."""
    return EVICTION_POLICIES.create(name, **kwargs)


def is_timed(name: str) -> bool:
    """Whether ``name``'s ``new_batch(now)`` takes a clock reading (its class's ``timed``)."""
    return bool(EVICTION_POLICIES.load(name).timed)
