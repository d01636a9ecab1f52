"""The routing policies by name: the one table of them, and the functions that build one.

Why it exists: the router, the cluster simulator and the CLI pick a policy by
name. Each policy is a ``Policy`` subclass in a module of its own; this table
maps its ``name`` to ``(module, class)`` and imports the module only when the
policy is first used, so the policy interface (``kvmesh.routing.policy``)
imports no implementation. Adding a policy: write its module, add one line here
(docs/router.md, "Adding a policy").
"""

from __future__ import annotations

from typing import Any

from kvmesh.registry import LazyRegistry
from kvmesh.routing.policy import Policy
from kvmesh.routing.scoring import ScoringConfig

POLICIES: LazyRegistry[type[Policy]] = LazyRegistry("routing policy", {
    "approx": ("kvmesh.routing.approx", "ApproxPolicy"),
    "dynamo": ("kvmesh.routing.dynamo", "DynamoPolicy"),
    "least_load": ("kvmesh.routing.least_load", "LeastLoadPolicy"),
    "llmd": ("kvmesh.routing.llmd", "LlmdPolicy"),
    "precise": ("kvmesh.routing.precise", "PrecisePolicy"),
    "random": ("kvmesh.routing.random_policy", "RandomPolicy"),
    "round_robin": ("kvmesh.routing.round_robin", "RoundRobinPolicy"),
    "session": ("kvmesh.routing.session", "SessionPolicy"),
})


def available_policies() -> list[str]:
    """Every policy name, sorted (imports none of them)."""
    return POLICIES.names()


def make_policy(name: str, scoring: ScoringConfig | None = None, **options: Any) -> Policy:
    """A new instance of the policy ``name``; ``ValueError`` names the choices for an unknown name."""
    return POLICIES.create(name, scoring, **options)
