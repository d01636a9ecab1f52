"""Free loopback ports for tests, benchmarks and the local stack (see :mod:`kvmesh.rpc.ports`)."""

from kvmesh.rpc.ports import free_port

__all__ = ["free_port"]
