"""kvmesh offload store service: the gRPC face of ``kvmesh.kvstore``."""
