"""Repository rules: services never import each other's code; stubs are fresh."""

from __future__ import annotations

import ast
import filecmp
from pathlib import Path

from kvmesh_tools.genprotos import generate

REPO = Path(__file__).resolve().parents[1]
SERVICES = ["router", "indexer", "prefill", "decode", "offload"]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
            "import_module", "__import__"
        ) and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            out.add(node.args[0].value.split(".")[0])
    return out


def find_cross_service_imports(repo: Path = REPO) -> list[str]:
    violations = []
    service_pkgs = {f"kvmesh_{s}" for s in SERVICES}
    for svc in SERVICES:
        for py in (repo / "services" / svc).rglob("*.py"):
            bad = (_imports(py) & service_pkgs) - {f"kvmesh_{svc}"}
            violations += [f"{py.relative_to(repo)} imports {b}" for b in sorted(bad)]
    for py in [*(repo / "libs" / "kvmesh").rglob("*.py"), *(repo / "libs" / "kvmesh_api").rglob("*.py")]:
        bad = _imports(py) & service_pkgs
        violations += [f"{py.relative_to(repo)} imports {b}" for b in sorted(bad)]
    return violations


def test_no_cross_service_imports() -> None:
    assert find_cross_service_imports() == []


def test_rule_checker_catches_a_violation(tmp_path: Path) -> None:
    pkg = tmp_path / "services" / "router" / "kvmesh_router"
    pkg.mkdir(parents=True)
    (pkg / "bad.py").write_text("from kvmesh_indexer.server import X\nimport importlib\nimportlib.import_module('kvmesh_decode.main')\n")
    (tmp_path / "libs").mkdir()
    found = find_cross_service_imports(tmp_path)
    assert any("kvmesh_indexer" in v for v in found) and any("kvmesh_decode" in v for v in found)


def test_every_service_has_its_own_folder() -> None:
    for svc in SERVICES:
        d = REPO / "services" / svc
        assert (d / f"kvmesh_{svc}" / "main.py").exists(), f"services/{svc} lacks kvmesh_{svc}/main.py"
        assert (d / "requirements.txt").exists(), f"services/{svc} lacks requirements.txt"
        assert (d / "Dockerfile").exists(), f"services/{svc} lacks a Dockerfile"


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    written = generate(REPO / "protos", tmp_path)
    stale = []
    for fresh in written:
        rel = fresh.relative_to(tmp_path)
        committed = REPO / "libs" / rel
        if not committed.exists() or not filecmp.cmp(fresh, committed, shallow=False):
            stale.append(str(rel))
    assert not stale, f"stubs are stale, run `make protos`: {stale}"
