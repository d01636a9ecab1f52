"""gRPC bootstrap shared by every kvmesh service: servers, channels, interceptors."""
