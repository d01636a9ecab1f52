"""Live replay: drive a running kvmesh stack with a trace, closed-loop, in real time.

Why it exists: the simulator predicts; this measures. The same schedule the
simulator uses is sent through the router's gRPC or OpenAI HTTP API, and the
stack's own answers (TTFT, streamed tokens, cached tokens by tier, the router's
prediction) are what gets reported.
"""

from kvmesh_tools.replay.client import ReplayConfig, ReplayResult, run_replay

__all__ = ["ReplayConfig", "ReplayResult", "run_replay"]
