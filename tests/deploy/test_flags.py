"""Every flag the compose files and Kubernetes manifests pass to a kvmesh service exists.

The deployment files are written against the services' command lines; this keeps
them honest as the services evolve: each ``--flag`` must appear in that service's
own ``--help`` (run through the container entrypoint, ``kvmesh.serve``).
"""

from __future__ import annotations

import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SERVICE_OF = {"indexer": "indexer", "router": "router", "router-1": "router", "router-2": "router",
              "offload": "offload",
              "prefill": "prefill", "prefill-1": "prefill", "decode": "decode", "decode-1": "decode",
              "decode-2": "decode"}

pytestmark = pytest.mark.timeout(180)


@cache
def service_flags(svc: str) -> frozenset[str]:
    out = subprocess.run([sys.executable, "-m", "kvmesh.serve", svc, "--help"], capture_output=True,
                         text=True, timeout=90)
    assert out.returncode == 0, f"{svc} --help failed:\n{out.stderr[-2000:]}"
    return frozenset(re.findall(r"(--[a-z0-9][a-z0-9-]*)", out.stdout))


def _flags(args: list[str]) -> list[str]:
    return [a for a in args if isinstance(a, str) and re.fullmatch(r"--[a-z0-9][a-z0-9-]*", a)]


def deployment_commands() -> list[tuple[str, str, list[str]]]:
    """(where, service, args) for every kvmesh container in compose and the k8s overlays."""
    found: list[tuple[str, str, list[str]]] = []
    for f in ("docker-compose.yml", "docker-compose.gpu.yml"):
        doc = yaml.safe_load((ROOT / f).read_text())
        for name, svc in doc["services"].items():
            if name in SERVICE_OF and svc.get("command"):
                found.append((f"{f}:{name}", SERVICE_OF[name], svc["command"]))
    kubectl = Path(sys.executable).parent / "kubectl"
    for overlay in ("dev", "gpu"):
        out = subprocess.run([str(kubectl), "kustomize", str(ROOT / "deploy/k8s/overlays" / overlay)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        for d in yaml.safe_load_all(out.stdout):
            if d and d["kind"] in ("Deployment", "StatefulSet") and d["metadata"]["name"] in SERVICE_OF:
                c = d["spec"]["template"]["spec"]["containers"][0]
                found.append((f"k8s/{overlay}:{d['metadata']['name']}", SERVICE_OF[d["metadata"]["name"]],
                              c["args"]))
    return found


def test_every_deployed_flag_exists() -> None:
    bad = []
    cmds = deployment_commands()
    assert {svc for _, svc, _ in cmds} == set(SERVICE_OF.values())
    for where, svc, args in cmds:
        missing = [f for f in _flags(args) if f not in service_flags(svc)]
        if missing:
            bad.append(f"{where} ({svc}): {missing}")
    assert not bad, "flags the services do not know:\n" + "\n".join(bad)
