"""``kvmesh soak``: many agent sessions for minutes against a running stack, minute by minute."""
