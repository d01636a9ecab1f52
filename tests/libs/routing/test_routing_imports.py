"""The routing core depends on the neutral perf model (kvmesh.perfmodel), never on an engine."""

from __future__ import annotations

import ast
from pathlib import Path

import kvmesh.routing

ROUTING = Path(kvmesh.routing.__file__).parent


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


def test_routing_imports_no_worker_module() -> None:
    files = sorted(ROUTING.rglob("*.py"))
    assert files
    bad = [f"{f.relative_to(ROUTING)}: {name}" for f in files for name in _imports(f)
           if name == "kvmesh.worker" or name.startswith("kvmesh.worker.")]
    assert not bad, bad


def test_scoring_defaults_are_the_perfmodel() -> None:
    from kvmesh.perfmodel import H100, KV_BYTES_PER_TOKEN
    from kvmesh.routing.scoring import ScoringConfig
    from kvmesh.worker.engine.sim.latency import LatencyParams

    sc = ScoringConfig()
    assert LatencyParams() == H100
    assert sc.prefill_s_per_token == H100.prefill_s_per_token == 250e-6
    assert sc.cpu_restore_s_per_token == KV_BYTES_PER_TOKEN / H100.h2d_bytes_per_s == 262_144 / 38e9
    assert sc.disk_restore_s_per_token == 262_144 / 5e9
