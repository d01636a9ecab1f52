"""kvmesh decode worker service."""
