"""The local kvmesh stack as child processes (``kvmesh up``, ``kvmesh demo``, live tests)."""

from kvmesh_tools.stack.launcher import LocalStack, StackConfig

__all__ = ["LocalStack", "StackConfig"]
