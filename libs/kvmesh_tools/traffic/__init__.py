"""Agent traffic: trace readers, token synthesis, a seeded session generator, the
closed-loop session schedule and ``kvmesh analyze``.

Why it exists: the simulator (``kvmesh_tools.clustersim``), the live replayer
(``kvmesh_tools.replay``) and the demo all consume the same in-memory trace model, so a
trace means the same thing whether it is replayed through real services or in
virtual time.
"""

from kvmesh_tools.traffic.model import Agent, Request, Session, Trace, chain_keys

__all__ = ["Agent", "Request", "Session", "Trace", "chain_keys"]
