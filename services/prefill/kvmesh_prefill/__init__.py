"""kvmesh prefill worker service."""
