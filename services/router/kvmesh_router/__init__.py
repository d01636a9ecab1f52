"""kvmesh router service: the front door (gRPC + OpenAI HTTP) around :mod:`kvmesh.routing`."""
