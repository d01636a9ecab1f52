"""Build the light ``kvmesh-connector`` wheel: the vLLM KV connector and the offload-store client only.

Why generated rather than a second source tree: the connector and the store
client live in ``libs/kvmesh`` with the rest of kvmesh, and a copy would drift.
The wheel holds exactly the first-party modules the connector (and its vLLM
plugin) import, found by reading their ``import`` statements (function-level
ones too), so a new import in the client is picked up at the next build and a
missing one fails the fresh-venv test. Metadata (Python >= 3.10, third-party
dependencies, the tested vLLM range as extras, the ``vllm.general_plugins``
entry point) comes from ``packaging/kvmesh-connector/pyproject.toml``.

    python -m kvmesh_tools.connector_dist --out dist      # or: make connector-wheel
"""

from __future__ import annotations

import argparse
import ast
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LIBS = REPO / "libs"
PACKAGING = REPO / "packaging" / "kvmesh-connector"
FIRST_PARTY = ("kvmesh", "kvmesh_api")
ROOTS = ("kvmesh.worker.connector.vllm_connector", "kvmesh.worker.connector.plugin", "kvmesh.kvstore.client")


def module_file(name: str, libs: Path = LIBS) -> Path | None:
    """The source file of a first-party module or package, or None when there is none."""
    base = libs.joinpath(*name.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def module_imports(path: Path, name: str) -> set[str]:
    """Every module ``path`` (module ``name``) imports, relative imports resolved; a
    ``from m import x`` also yields ``m.x`` (a module or not: callers keep what exists)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def closure(roots: tuple[str, ...] = ROOTS, libs: Path = LIBS) -> dict[str, Path]:
    """Every first-party module the roots import (transitively), with their parent packages."""
    found: dict[str, Path] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        path = module_file(name, libs)
        if path is None:
            if name in roots:
                raise FileNotFoundError(f"root module {name} not found under {libs}")
            continue  # "from pkg import attr": attr is no module
        found[name] = path
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        todo.extend(m for m in module_imports(path, name) if m.split(".")[0] in FIRST_PARTY)
    return found


def stage(dest: Path, libs: Path = LIBS) -> list[str]:
    """Lay out a buildable project in ``dest``: the packaging files plus ``src/`` with the closure."""
    shutil.copytree(PACKAGING, dest, dirs_exist_ok=True)
    mods = closure(libs=libs)
    for path in mods.values():
        target = dest / "src" / path.relative_to(libs)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    return sorted(mods)


def build(out: Path) -> Path:
    """Build the wheel into ``out`` with this interpreter's setuptools (no downloads); returns its path."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvmesh-connector-") as tmp:
        stage(Path(tmp))
        before = set(out.glob("kvmesh_connector-*.whl"))
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(out), tmp], check=True)
    wheels = sorted(set(out.glob("kvmesh_connector-*.whl")) - before) or sorted(out.glob("kvmesh_connector-*.whl"))
    if not wheels:
        raise RuntimeError(f"no kvmesh_connector wheel in {out}")
    return max(wheels, key=lambda p: p.stat().st_mtime)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvmesh_tools.connector_dist", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="dist", help="directory the wheel is written to (default: dist)")
    ap.add_argument("--list", action="store_true", help="print the modules the wheel holds and exit")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(sorted(closure())))
        return 0
    print(build(Path(args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
