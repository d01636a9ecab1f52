"""Benchmarks, one module per component; each exposes ``register(subparsers)``
adding ``kvmesh bench <name> --json PATH`` and is listed in
``kvmesh_tools.cli.registry.BENCHES``. Results are JSON with medians and
same-run baselines, never hard-coded figures."""
