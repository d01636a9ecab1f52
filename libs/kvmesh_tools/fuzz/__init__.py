"""gRPC fuzzing of kvmesh services (``kvmesh fuzz``, tests/security)."""
