"""Every flag the compose files and Kubernetes manifests pass to a kvmesh service exists,
and every service's and config-taking tool's ``--help`` names each option's default and env.

The deployment files are written against the services' command lines; this keeps
them honest as the services evolve: each ``--flag`` must appear in that service's
own ``--help`` (run through the container entrypoint, ``kvmesh.serve``). An operator
configuring a container by environment reads the env names in the same ``--help``.
"""

from __future__ import annotations

import argparse
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

# The kvmesh commands that take settings (a kvmesh.config dataclass).
CONFIG_TOOLS = ("replay", "simulate", "up")

pytestmark = pytest.mark.timeout(180)


@cache
def help_text(kind: str, name: str) -> str:
    """``--help`` of a service (through ``kvmesh.serve``) or of a ``kvmesh`` command."""
    module = "kvmesh.serve" if kind == "service" else "kvmesh_tools.cli.main"
    out = subprocess.run([sys.executable, "-m", module, name, "--help"], capture_output=True, text=True,
                         timeout=90)
    assert out.returncode == 0, f"{name} --help failed:\n{out.stderr[-2000:]}"
    return out.stdout


def service_flags(svc: str) -> frozenset[str]:
    return frozenset(re.findall(r"(--[a-z0-9][a-z0-9-]*)", help_text("service", svc)))


def help_entries(text: str) -> dict[str, str]:
    """Long option -> its whole ``--help`` entry (wrapped lines joined)."""
    entries: dict[str, str] = {}
    cur = None
    for line in text.splitlines():
        if re.match(r"^  -\S", line):       # an option's first line
            opts = re.findall(r"--[a-z0-9][a-z0-9-]*", line.strip().split("  ")[0])
            cur = opts[-1] if opts else line.split()[0]
            entries[cur] = line
        elif cur is not None and line.startswith("   "):
            entries[cur] += " " + line.strip()
        else:
            cur = None
    return {k: " ".join(v.split()) for k, v in entries.items()}


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


def options_without_env(entries: dict[str, str]) -> list[str]:
    """Entries (other than --help) that do not end in ``(default: ...; env KVMESH_..._<FLAG>)``."""
    bad = []
    for flag, text in entries.items():
        m = re.search(r"\(default: [^()]*; env (KVMESH_[A-Z0-9_]+)\)", text)
        # The env name ends with the flag's own name (a nested setting adds its section).
        if flag != "--help" and (m is None or not m.group(1).endswith(flag[2:].upper().replace("-", "_"))):
            bad.append(text)
    return bad


@pytest.mark.parametrize(("kind", "name"), [*(("service", s) for s in sorted(set(SERVICE_OF.values()))),
                                            *(("tool", t) for t in CONFIG_TOOLS)])
def test_help_names_every_options_default_and_env(kind: str, name: str) -> None:
    entries = help_entries(help_text(kind, name))
    assert "--help" in entries and len(entries) > 5, entries
    bad = options_without_env(entries)
    assert not bad, f"{name} --help options without a default and env name:\n" + "\n".join(bad)


def test_env_checker_catches_an_option_without_env() -> None:
    from kvmesh.config import add_dataclass_args
    from kvmesh.routing.scoring import ScoringConfig

    p = argparse.ArgumentParser()
    add_dataclass_args(p, ScoringConfig)          # no env prefix: defaults only
    p.add_argument("--extra", help="a plain flag")
    entries = help_entries(p.format_help())
    assert len(options_without_env(entries)) == len(entries) - 1   # all but --help
    p = argparse.ArgumentParser()
    add_dataclass_args(p, ScoringConfig, env_prefix="KVMESH_X_")
    assert options_without_env(help_entries(p.format_help())) == []
