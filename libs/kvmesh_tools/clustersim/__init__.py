"""Virtual-time cluster simulator: the real routing, index, block manager, latency
model and offload tier, driven by a discrete-event loop instead of the wall clock.

Why it exists: "what hit rate could we get, and what would more workers, offload
or another policy change?" has to be answered for hundreds of workers and
thousands of agent sessions in minutes, on a laptop, with the same code that
decides in production.
"""

from kvmesh_tools.clustersim.config import SimConfig
from kvmesh_tools.clustersim.run import simulate_policies, simulate_regimes
from kvmesh_tools.clustersim.seeds import simulate_seeds
from kvmesh_tools.clustersim.sim import ClusterSim, PolicyResult

__all__ = ["ClusterSim", "PolicyResult", "SimConfig", "simulate_policies", "simulate_regimes", "simulate_seeds"]
