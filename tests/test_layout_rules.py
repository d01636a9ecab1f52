"""Repository rules: who may import whom, what lives where, who owns it.

* libs (``kvmesh``, ``kvmesh_api``) never import tools (``kvmesh_tools``) or
  services (``kvmesh_<service>``);
* services never import each other or ``kvmesh_tools``;
* the routing core (``libs/kvmesh/routing``) never imports an engine
  (``kvmesh.worker``);
* ``libs/kvmesh_api`` holds only generated stubs, and they are fresh, and every
  dependency list asks for the grpcio and protobuf they were generated for;
* every test folder mirrors an existing code room;
* every ``.github/CODEOWNERS`` path exists and every service and shared room
  has an owner.

Each rule is a ``find_*`` function over a repository root, so a test can run it
on a ``tmp_path`` tree and show that it catches a violation.
"""

from __future__ import annotations

import ast
import filecmp
import re
import tomllib
from pathlib import Path

from kvmesh_tools.genprotos import generate

REPO = Path(__file__).resolve().parents[1]
SERVICES = ["router", "indexer", "prefill", "decode", "offload"]


def _full_imports(path: Path) -> set[str]:
    """Dotted names of every absolute import in ``path`` (incl. import_module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names if a.name != "*"}
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
            "import_module", "__import__"
        ) and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            out.add(node.args[0].value)
    return out


def _imports(path: Path) -> set[str]:
    """Top-level package names imported by ``path``."""
    return {name.split(".")[0] for name in _full_imports(path)}


def _py_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts) if root.is_dir() else []


def find_cross_service_imports(repo: Path = REPO) -> list[str]:
    """Services importing another service; libs importing any service."""
    violations = []
    service_pkgs = {f"kvmesh_{s}" for s in SERVICES}
    for svc in SERVICES:
        for py in _py_files(repo / "services" / svc):
            bad = (_imports(py) & service_pkgs) - {f"kvmesh_{svc}"}
            violations += [f"{py.relative_to(repo)} imports {b}" for b in sorted(bad)]
    for py in [*_py_files(repo / "libs" / "kvmesh"), *_py_files(repo / "libs" / "kvmesh_api")]:
        bad = _imports(py) & service_pkgs
        violations += [f"{py.relative_to(repo)} imports {b}" for b in sorted(bad)]
    return violations


def find_tool_imports(repo: Path = REPO) -> list[str]:
    """Libs (kvmesh, kvmesh_api) or services importing the tools (kvmesh_tools)."""
    roots = [repo / "libs" / "kvmesh", repo / "libs" / "kvmesh_api", *(repo / "services" / s for s in SERVICES)]
    return [
        f"{py.relative_to(repo)} imports kvmesh_tools"
        for root in roots
        for py in _py_files(root)
        if "kvmesh_tools" in _imports(py)
    ]


def find_routing_engine_imports(repo: Path = REPO) -> list[str]:
    """The routing core importing an engine (anything under kvmesh.worker)."""
    violations = []
    for py in _py_files(repo / "libs" / "kvmesh" / "routing"):
        bad = {n for n in _full_imports(py) if n == "kvmesh.worker" or n.startswith("kvmesh.worker.")}
        # ``from kvmesh import worker`` shows up as "kvmesh.worker" too; report
        # ``from a.b import C`` once, as a.b, not also as a.b.C.
        bad = {n for n in bad if not any(n.startswith(f"{m}.") for m in bad)}
        violations += [f"{py.relative_to(repo)} imports {b}" for b in sorted(bad)]
    return violations


GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def _docstring_only(path: Path) -> bool:
    body = ast.parse(path.read_text(), filename=str(path)).body
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
               for n in body)


def find_hand_written_api_files(repo: Path = REPO) -> list[str]:
    """Files in libs/kvmesh_api that protoc did not write from protos/.

    Allowed: ``<stem>_pb2.py``, ``<stem>_pb2.pyi``, ``<stem>_pb2_grpc.py`` next to
    a ``protos/<same dir>/<stem>.proto``, and ``__init__.py`` files holding at
    most a docstring.
    """
    api = repo / "libs" / "kvmesh_api"
    violations = []
    if not api.is_dir():
        return violations
    for f in sorted(api.rglob("*")):
        if f.is_dir() or "__pycache__" in f.parts or f.suffix == ".pyc":
            continue
        rel = f.relative_to(repo / "libs")
        if f.name == "__init__.py":
            if not _docstring_only(f):
                violations.append(f"libs/{rel} has code (only a docstring is allowed)")
            continue
        suffix = next((s for s in GENERATED_SUFFIXES if f.name.endswith(s)), None)
        if suffix is None:
            violations.append(f"libs/{rel} is not a generated stub")
            continue
        proto = repo / "protos" / rel.parent / (f.name[: -len(suffix)] + ".proto")
        if not proto.exists():
            violations.append(f"libs/{rel} has no proto at {proto.relative_to(repo)}")
    return violations


# Test folders that hold support code, or a suite that crosses every room (security: the
# attacks of issue #20 against the whole mesh), rather than mirror a code room.
TEST_SUPPORT_DIRS = {"data", "fixtures", "helpers", "security"}
# tests/<top> mirrors this code root.
TEST_MIRRORS = {"libs": "libs/kvmesh", "services": "services", "tools": "libs/kvmesh_tools", "deploy": "deploy"}


def find_unmirrored_test_dirs(repo: Path = REPO) -> list[str]:
    """Test folders that do not mirror an existing code room.

    tests/libs/X/Y -> libs/kvmesh/X/Y, tests/services/X -> services/X,
    tests/tools/X -> libs/kvmesh_tools/X, tests/deploy/X -> deploy/X.
    """
    tests = repo / "tests"
    violations = []
    if not tests.is_dir():
        return violations
    for top in sorted(d for d in tests.iterdir() if d.is_dir() and d.name != "__pycache__"):
        if top.name in TEST_SUPPORT_DIRS:
            continue
        if top.name not in TEST_MIRRORS:
            violations.append(f"tests/{top.name} mirrors no code root (expected one of {sorted(TEST_MIRRORS)})")
            continue
        code_root = repo / TEST_MIRRORS[top.name]
        if not code_root.is_dir():
            violations.append(f"tests/{top.name} mirrors {TEST_MIRRORS[top.name]}, which does not exist")
            continue
        for d in sorted(top.rglob("*")):
            if not d.is_dir() or "__pycache__" in d.parts:
                continue
            rel = d.relative_to(top)
            if not (code_root / rel).is_dir():
                violations.append(f"tests/{top.name}/{rel} has no code room {TEST_MIRRORS[top.name]}/{rel}")
    return violations


def codeowners_rules(repo: Path = REPO) -> list[tuple[str, list[str]]]:
    """(pattern, owners) for every rule line of .github/CODEOWNERS."""
    path = repo / ".github" / "CODEOWNERS"
    rules = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            pattern, *owners = line.split()
            rules.append((pattern, owners))
    return rules


def owned_rooms(repo: Path = REPO) -> list[str]:
    """The rooms that need a named owner: every service, every package of
    libs/kvmesh, the stubs, the protos, the tools, deploy, every test room."""
    rooms = [f"services/{d.name}/" for d in sorted((repo / "services").iterdir()) if d.is_dir()]
    rooms += [
        f"libs/kvmesh/{d.name}/"
        for d in sorted((repo / "libs" / "kvmesh").iterdir())
        if (d / "__init__.py").exists()
    ]
    rooms += ["libs/kvmesh_api/", "protos/", "libs/kvmesh_tools/", "deploy/"]
    for top in ("libs", "services"):
        base = repo / "tests" / top
        if base.is_dir():
            rooms += [f"tests/{top}/{d.name}/" for d in sorted(base.iterdir()) if (d / "__init__.py").exists()]
    rooms += [f"tests/{t}/" for t in ("tools", "deploy") if (repo / "tests" / t).is_dir()]
    return rooms


def find_codeowners_problems(repo: Path = REPO) -> list[str]:
    """CODEOWNERS paths that do not exist; rooms without their own owner line;
    rules without an owner."""
    if not (repo / ".github" / "CODEOWNERS").exists():
        return [".github/CODEOWNERS is missing"]
    rules = codeowners_rules(repo)
    problems = []
    for pattern, owners in rules:
        if not owners or not all(o.startswith("@") for o in owners):
            problems.append(f"CODEOWNERS {pattern} has no @owner")
        if any(c in pattern for c in "*?["):
            continue  # globs match no single path
        if not (repo / pattern.strip("/")).exists():
            problems.append(f"CODEOWNERS {pattern} does not exist")
    listed = {p.strip("/") for p, _ in rules}
    problems += [f"{room} has no owner in CODEOWNERS" for room in owned_rooms(repo) if room.strip("/") not in listed]
    return problems


def test_no_cross_service_imports() -> None:
    assert find_cross_service_imports() == []


def test_rule_checker_catches_a_violation(tmp_path: Path) -> None:
    pkg = tmp_path / "services" / "router" / "kvmesh_router"
    pkg.mkdir(parents=True)
    (pkg / "bad.py").write_text("from kvmesh_indexer.server import X\nimport importlib\nimportlib.import_module('kvmesh_decode.main')\n")
    (tmp_path / "libs").mkdir()
    found = find_cross_service_imports(tmp_path)
    assert any("kvmesh_indexer" in v for v in found) and any("kvmesh_decode" in v for v in found)


def test_libs_and_services_never_import_tools() -> None:
    assert find_tool_imports() == []


def test_tool_rule_catches_a_violation(tmp_path: Path) -> None:
    lib = tmp_path / "libs" / "kvmesh" / "routing"
    svc = tmp_path / "services" / "indexer" / "kvmesh_indexer"
    api = tmp_path / "libs" / "kvmesh_api" / "router" / "v1"
    for d in (lib, svc, api):
        d.mkdir(parents=True)
    (lib / "a.py").write_text("from kvmesh_tools.bench import run\n")
    (svc / "b.py").write_text("def f():\n    import kvmesh_tools.cli\n")
    (api / "c.py").write_text("import importlib\nimportlib.import_module('kvmesh_tools.stack')\n")
    (tmp_path / "libs" / "kvmesh" / "ok.py").write_text("import kvmesh.routing\n")
    found = find_tool_imports(tmp_path)
    assert len(found) == 3, found
    assert {v.split()[0] for v in found} == {
        "libs/kvmesh/routing/a.py", "services/indexer/kvmesh_indexer/b.py", "libs/kvmesh_api/router/v1/c.py"
    }


def test_libs_never_import_services_catches_a_violation(tmp_path: Path) -> None:
    lib = tmp_path / "libs" / "kvmesh" / "kvstore"
    lib.mkdir(parents=True)
    (lib / "bad.py").write_text("from kvmesh_offload.store import Store\n")
    found = find_cross_service_imports(tmp_path)
    assert found == ["libs/kvmesh/kvstore/bad.py imports kvmesh_offload"]


def test_routing_core_never_imports_an_engine() -> None:
    assert find_routing_engine_imports() == []


def test_routing_engine_rule_catches_a_violation(tmp_path: Path) -> None:
    routing = tmp_path / "libs" / "kvmesh" / "routing"
    routing.mkdir(parents=True)
    (routing / "a.py").write_text("from kvmesh.worker.engine.sim.latency import LatencyParams\n")
    (routing / "b.py").write_text("from kvmesh import worker\n")
    (routing / "ok.py").write_text("from kvmesh.index.base import Tier\nimport kvmesh.workers_list\n")
    found = find_routing_engine_imports(tmp_path)
    assert [v.split()[0] for v in found] == ["libs/kvmesh/routing/a.py", "libs/kvmesh/routing/b.py"], found


def test_kvmesh_api_holds_only_generated_code() -> None:
    assert find_hand_written_api_files() == []


def test_generated_code_rule_catches_a_violation(tmp_path: Path) -> None:
    v1 = tmp_path / "libs" / "kvmesh_api" / "router" / "v1"
    v1.mkdir(parents=True)
    (tmp_path / "protos" / "kvmesh_api" / "router" / "v1").mkdir(parents=True)
    (tmp_path / "protos" / "kvmesh_api" / "router" / "v1" / "router.proto").write_text("")
    (tmp_path / "libs" / "kvmesh_api" / "__init__.py").write_text('"""Stubs only."""\n')
    (v1 / "__init__.py").write_text("from .helpers import nice\n")
    (v1 / "router_pb2.py").write_text("")
    (v1 / "router_pb2_grpc.py").write_text("")
    (v1 / "helpers.py").write_text("def nice(): ...\n")
    (v1 / "orphan_pb2.py").write_text("")
    found = find_hand_written_api_files(tmp_path)
    assert len(found) == 3, found
    assert any("v1/__init__.py has code" in v for v in found)
    assert any("helpers.py is not a generated stub" in v for v in found)
    assert any("orphan_pb2.py has no proto" in v for v in found)


def test_every_test_folder_mirrors_a_code_room() -> None:
    assert find_unmirrored_test_dirs() == []


def test_mirror_rule_catches_a_violation(tmp_path: Path) -> None:
    for d in ("libs/kvmesh/routing", "services/router", "libs/kvmesh_tools/traffic", "deploy"):
        (tmp_path / d).mkdir(parents=True)
    for d in ("libs/routing", "libs/index", "services/router", "services/gateway", "tools/traffic",
              "fixtures", "misc"):
        (tmp_path / "tests" / d).mkdir(parents=True)
    found = find_unmirrored_test_dirs(tmp_path)
    assert [v.split()[0] for v in found] == ["tests/libs/index", "tests/misc", "tests/services/gateway"], found


def test_codeowners_paths_exist_and_every_room_has_an_owner() -> None:
    assert find_codeowners_problems() == []


def test_codeowners_rule_catches_a_violation(tmp_path: Path) -> None:
    for d in ("services/router", "services/indexer", "libs/kvmesh/routing", "libs/kvmesh_api",
              "libs/kvmesh_tools", "protos", "deploy", "tests/tools"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "libs" / "kvmesh" / "routing" / "__init__.py").write_text("")
    (tmp_path / ".github").mkdir()
    (tmp_path / ".github" / "CODEOWNERS").write_text(
        "*  @kvmesh/maintainers\n"
        "/services/router/  @kvmesh/router  # trailing comment\n"
        "/services/gateway/  @kvmesh/router\n"
        "/libs/kvmesh/routing/\n"
        "/libs/kvmesh_api/ @kvmesh/api\n/libs/kvmesh_tools/ @kvmesh/tools\n"
        "/protos/ @kvmesh/api\n/deploy/ @kvmesh/deploy\n/tests/tools/ @kvmesh/tools\n"
    )
    found = find_codeowners_problems(tmp_path)
    assert sorted(found) == sorted([
        "CODEOWNERS /services/gateway/ does not exist",
        "CODEOWNERS /libs/kvmesh/routing/ has no @owner",
        "services/indexer/ has no owner in CODEOWNERS",
    ]), found


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


def _stub_minimums() -> dict[str, str]:
    """The runtime versions the committed stubs refuse to load below: a ``*_pb2_grpc`` module
    raises on an older grpcio, a ``*_pb2`` module on an older protobuf."""
    api = REPO / "libs" / "kvmesh_api" / "offload" / "v1"
    grpc_ver = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", (api / "offload_pb2_grpc.py").read_text())
    pb_ver = re.search(r"Domain.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", (api / "offload_pb2.py").read_text())
    assert grpc_ver and pb_ver
    grpc_min = grpc_ver.group(1)
    return {"grpcio": grpc_min, "grpcio-health-checking": grpc_min, "grpcio-reflection": grpc_min,
            "protobuf": ".".join(pb_ver.groups())}


def find_stale_minimums(root: Path, minimums: dict[str, str]) -> list[str]:
    """Declarations of a stub runtime whose ``>=`` differs from the stubs' own minimum: an
    install that honours a lower one imports stubs that refuse to load."""
    lists = {"pyproject.toml": tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]}
    for req in sorted((root / "services").glob("*/requirements.txt")):
        lists[str(req.relative_to(root))] = [ln.strip() for ln in req.read_text().splitlines()
                                             if ln.strip() and not ln.startswith("#")]
    problems = []
    for where, deps in lists.items():
        for dep in deps:
            name, _, low = dep.partition(">=")
            if name.strip() in minimums and low.strip() != minimums[name.strip()]:
                problems.append(f"{where}: {dep} (the stubs need >={minimums[name.strip()]})")
    return problems


def test_dependency_lists_ask_for_the_stubs_runtime() -> None:
    assert not find_stale_minimums(REPO, _stub_minimums())


def test_a_lower_runtime_minimum_is_caught(tmp_path: Path) -> None:
    (tmp_path / "services" / "router").mkdir(parents=True)
    (tmp_path / "pyproject.toml").write_text('[project]\ndependencies = ["grpcio>=1.60", "redis>=5"]\n')
    (tmp_path / "services" / "router" / "requirements.txt").write_text("# router\nprotobuf>=7.35.1\n")
    found = find_stale_minimums(tmp_path, {"grpcio": "1.85.1", "protobuf": "7.35.1"})
    assert found == ["pyproject.toml: grpcio>=1.60 (the stubs need >=1.85.1)"]
