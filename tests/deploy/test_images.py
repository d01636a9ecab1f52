"""Service images: Dockerfile structure, dependency lists and the container health check.

No Docker engine runs here, so the images are checked statically: multi-stage,
slim Python 3.11 base, non-root runtime, gRPC health check, entrypoint. Each
service's ``requirements.txt`` is checked against what its code really imports:
every third-party module reachable from the service's ``main`` (following
``kvmesh.*`` imports) must come from a listed distribution, so a slim image
never misses a dependency. The health-check tool is run against a real gRPC
server.
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
import subprocess
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

from kvmesh.rpc.server import ServerOptions, ServiceServer
from kvmesh_tools.connector_dist import module_imports
from kvmesh_tools.testing.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ["router", "indexer", "offload", "prefill", "decode"]
# Imported only when the vLLM engine is selected; listed in requirements-vllm.txt.
VLLM_ONLY = {"vllm", "torch"}

pytestmark = pytest.mark.timeout(120)


def _stages(text: str) -> list[str]:
    return re.split(r"(?m)^FROM\s", text)[1:]


@pytest.mark.parametrize("svc", SERVICES)
def test_dockerfile_shape(svc: str) -> None:
    path = ROOT / "services" / svc / "Dockerfile"
    text = path.read_text()
    stages = _stages(text)
    assert len(stages) >= 2, "multi-stage build expected"
    assert re.search(r"(?m)^ARG PYTHON_IMAGE=python:3\.11-slim", text)
    runtime = stages[-1]
    user = re.findall(r"(?m)^USER\s+(\S+)", runtime)
    assert user and user[-1].split(":")[0] not in ("0", "root"), "runtime must not run as root"
    assert "pip" not in re.sub(r"#.*", "", runtime), "no package installs in the runtime stage"
    assert re.search(r'HEALTHCHECK .*\n?.*"kvmesh\.rpc\.healthcheck", "127\.0\.0\.1:50051"', text)
    assert f'ENTRYPOINT ["python", "-m", "kvmesh.serve", "{svc}"]' in text
    for src in re.findall(r"(?m)^COPY (?!--from)(\S+)", text):
        if "*" in src:
            assert list(ROOT.glob(src)), f"COPY {src} matches nothing"
        else:
            assert (ROOT / src).exists(), f"COPY {src} does not exist"
    assert (ROOT / "services" / svc / "requirements.txt").exists()


def _requirement_names(path: Path) -> set[str]:
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            names.add(re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0].lower().replace("_", "-"))
    return names


def _module_file(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or spec.origin in ("built-in", "frozen"):
        return None
    return Path(spec.origin)


def third_party_imports(entry: str, first_party: tuple[str, ...]) -> dict[str, str]:
    """Top-level third-party modules reachable from ``entry`` -> an importing module."""
    seen: set[str] = set()
    todo = [entry, "kvmesh.serve", "kvmesh.rpc.healthcheck"]
    found: dict[str, str] = {}
    stdlib = set(sys.stdlib_module_names)
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        f = _module_file(mod)
        if f is None or f.suffix != ".py":
            continue
        for imp in module_imports(f, mod):
            top = imp.split(".")[0]
            if not top or top in stdlib or top == "__future__":
                continue
            if top in first_party:
                if _module_file(imp) is not None:
                    todo.append(imp)
                continue
            found.setdefault(top, mod)
    return found


@pytest.mark.parametrize("svc", SERVICES)
def test_requirements_cover_every_import(svc: str) -> None:
    entry = f"kvmesh_{svc}.main"
    if _module_file(entry) is None:
        pytest.fail(f"{entry} not importable")
    # The other services' packages are absent from this image (see the Dockerfile).
    found = third_party_imports(entry, ("kvmesh", "kvmesh_api", f"kvmesh_{svc}"))
    listed = _requirement_names(ROOT / "services" / svc / "requirements.txt")
    vllm_file = ROOT / "services" / svc / "requirements-vllm.txt"
    optional = _requirement_names(vllm_file) if vllm_file.exists() else set()
    # Other build options' files (requirements-<option>.txt) cover what only that option imports.
    extras: set[str] = set()
    for f in (ROOT / "services" / svc).glob("requirements-*.txt"):
        extras |= _requirement_names(f)
    dists = packages_distributions()
    missing = {}
    for top, where in found.items():
        if top.startswith("kvmesh_"):
            missing[top] = f"{where} imports another service's package"
            continue
        names = {d.lower().replace("_", "-") for d in dists.get(top, [top])}
        if top in VLLM_ONLY and "vllm" in optional:
            continue
        if not names & (listed | extras):
            missing[top] = f"{where} (distribution {sorted(names)})"
    assert not missing, f"services/{svc}/requirements.txt lacks: {missing}"


# --------------------------------------------------------------------------- health check tool


def _run_check(address: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvmesh.rpc.healthcheck", address, "--timeout", "2", *extra],
                          capture_output=True, text=True, timeout=30)


async def test_healthcheck_tool_follows_readiness() -> None:
    server = ServiceServer("hc-test", [], ServerOptions(host="127.0.0.1", port=0, grace_s=0))
    await server.start()
    addr = f"127.0.0.1:{server.port}"
    try:
        r = await asyncio.to_thread(_run_check, addr)
        assert r.returncode == 1 and "NOT_SERVING" in r.stderr
        live = await asyncio.to_thread(_run_check, addr, "--service", "liveness")
        assert live.returncode == 0 and "SERVING" in live.stdout
        await server.set_ready(True)
        r = await asyncio.to_thread(_run_check, addr)
        assert r.returncode == 0, r.stderr
        r = await asyncio.to_thread(_run_check, addr, "--service", "no.such.Service")
        assert r.returncode == 1 and "unknown" in r.stderr
    finally:
        await server.stop(0)
    r = await asyncio.to_thread(_run_check, addr)
    assert r.returncode == 2 and addr in r.stderr


def test_healthcheck_tool_rejects_bad_usage() -> None:
    r = subprocess.run([sys.executable, "-m", "kvmesh.rpc.healthcheck", "no-port-here"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 64 and "HOST:PORT" in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvmesh.rpc.healthcheck", f"127.0.0.1:{free_port()}",
                        "--timeout", "0.5"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2


def test_serve_launcher_lists_services_on_bad_name() -> None:
    r = subprocess.run([sys.executable, "-m", "kvmesh.serve", "nope"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 64 and "router" in r.stderr
