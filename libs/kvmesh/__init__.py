"""kvmesh: the shared library of the kvmesh services.

Services (router, indexer, prefill, decode, offload) share code only through this
package and the generated protobuf stubs under ``kvmesh.<service>.v1``.
"""

__version__ = "0.1.0"
