"""Routing core shared by the router service and the virtual-time cluster simulator.

Everything here is synchronous and free of I/O; time is passed in as ``now``
(seconds, any monotonic clock), so the same code decides in the live router
and in a simulation that runs faster than real time.
"""

from kvmesh.routing.load import LoadReport, LoadView
from kvmesh.routing.policy import Policy
from kvmesh.routing.registry import available_policies, make_policy
from kvmesh.routing.scoring import ScoringConfig
from kvmesh.routing.types import Decision, EndpointView, Matches, RouteRequest, TierMatch

__all__ = [
    "Decision",
    "EndpointView",
    "LoadReport",
    "LoadView",
    "Matches",
    "Policy",
    "RouteRequest",
    "ScoringConfig",
    "TierMatch",
    "available_policies",
    "make_policy",
]
