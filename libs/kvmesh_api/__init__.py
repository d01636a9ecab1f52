"""kvmesh_api: the generated protobuf/gRPC stubs of every kvmesh contract.

One subpackage per service (``kvmesh_api.<service>.v1``), generated from
``protos/kvmesh_api/`` by ``make protos`` and committed so that images need no
protoc. The wire names stay ``kvmesh.<service>.v1`` (see the ``package`` line of
each proto). Nothing but generated code lives here.
"""
