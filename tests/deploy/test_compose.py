"""docker-compose files: valid per docker-compose's own ``config`` and the compose-spec JSON schema.

There is no Docker engine here; ``docker-compose config`` (Debian's docker-compose,
installed by ``make install``) parses, merges and validates without one, and the
compose-spec schema it ships is applied to the files with ``jsonschema`` as well.
Then the stack's promises are checked: which services run, health checks, GPU
override, and that every file the stack mounts or builds from exists.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

import kvmesh

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "docker-compose.yml"
GPU = ROOT / "docker-compose.gpu.yml"
EXTERNAL = ROOT / "docker-compose.vllm-external.yml"
ROUTERS = {"router-1", "router-2"}
KVMESH = ROUTERS | {"indexer", "offload", "prefill-1", "decode-1", "decode-2"}
REQUIRED = KVMESH | {"redis", "otel-collector", "jaeger", "prometheus"}
WORKERS = {"prefill-1", "decode-1", "decode-2"}

pytestmark = pytest.mark.timeout(120)


def _compose_bin() -> str:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail("docker-compose not installed: run `make install` (apt package docker-compose)")
    return exe


def compose_config(*files: Path) -> dict[str, Any]:
    args = [_compose_bin()]
    for f in files:
        args += ["-f", str(f)]
    out = subprocess.run([*args, "config"], capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"})
    assert out.returncode == 0, f"docker-compose config {[f.name for f in files]} failed:\n{out.stderr}"
    return yaml.safe_load(out.stdout)


def compose_spec_schema() -> dict[str, Any]:
    """The compose-spec JSON schema shipped inside docker-compose's Python package."""
    exe = Path(_compose_bin())
    shebang = exe.read_text(errors="replace").splitlines()[0]
    python = shebang[2:].strip().split()[0] if shebang.startswith("#!") else "python3"
    out = subprocess.run([python, "-c", "import compose.config as c, os; print(os.path.dirname(c.__file__))"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads((Path(out.stdout.strip()) / "compose_spec.json").read_text())


@pytest.fixture(scope="module")
def base() -> dict[str, Any]:
    return compose_config(BASE)


@pytest.fixture(scope="module")
def gpu() -> dict[str, Any]:
    return compose_config(BASE, GPU)


def test_files_match_the_compose_spec_schema() -> None:
    schema = compose_spec_schema()
    validator = jsonschema.Draft7Validator(schema)
    for f in (BASE, GPU, EXTERNAL):
        errors = sorted(validator.iter_errors(yaml.safe_load(f.read_text())), key=lambda e: list(e.path))
        assert not errors, f"{f.name}: " + "; ".join(f"{list(e.path)}: {e.message}" for e in errors[:5])


def test_schema_and_config_reject_a_broken_file(tmp_path: Path) -> None:
    doc = yaml.safe_load(BASE.read_text())
    doc["services"]["router-1"]["healthcheck"] = {"test": ["CMD", "true"], "intervall": "5s"}
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(yaml.safe_dump(doc))
    assert list(jsonschema.Draft7Validator(compose_spec_schema()).iter_errors(doc))
    out = subprocess.run([_compose_bin(), "-f", str(bad), "config", "-q"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode != 0 and "intervall" in out.stderr


def test_stack_services_and_health(base: dict[str, Any]) -> None:
    services = base["services"]
    assert REQUIRED <= set(services), f"missing: {REQUIRED - set(services)}"
    for name in KVMESH:
        svc = services[name]
        test = svc["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "kvmesh.rpc.healthcheck"], (name, test)
        dockerfile = ROOT / svc["build"]["dockerfile"]
        assert dockerfile.exists(), dockerfile
        assert svc["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"].startswith("http://otel-collector:")
    # start order: workers wait for a healthy indexer and offload store; the router for the workers
    for w in WORKERS:
        assert services[w]["depends_on"]["indexer"]["condition"] == "service_healthy"
    for r in ROUTERS:
        assert WORKERS <= set(services[r]["depends_on"])
    assert services["redis"]["healthcheck"]["test"][-1] == "ping"


def test_replicated_routers_sit_behind_the_gateway_with_retries(base: dict[str, Any]) -> None:
    """Two identical routers; Envoy's two ways in (their HTTP front doors and their ext_proc
    pickers) list both and retry a refused or dropped try on the other one."""
    services = base["services"]
    assert services["router-1"]["command"] == services["router-2"]["command"]
    assert not any(services[r].get("ports") for r in ROUTERS)
    gw = services["gateway"]
    assert ROUTERS <= set(gw["depends_on"]) and all(gw["depends_on"][r]["condition"] == "service_healthy"
                                                    for r in ROUTERS)
    published = {str(p["published"]) if isinstance(p, dict) else p.split(":")[0] for p in gw["ports"]}
    assert {"8000", "8080"} <= published
    envoy = yaml.safe_load((ROOT / "deploy" / "envoy" / "envoy.yaml").read_text())
    clusters = {c["name"]: c for c in envoy["static_resources"]["clusters"]}
    for name, port in (("kvmesh-routers", 8000), ("kvmesh-epp", 9002)):
        hosts = {(e["endpoint"]["address"]["socket_address"]["address"],
                  e["endpoint"]["address"]["socket_address"]["port_value"])
                 for e in clusters[name]["load_assignment"]["endpoints"][0]["lb_endpoints"]}
        assert hosts == {(r, port) for r in ROUTERS}, name
        assert clusters[name]["health_checks"], name
        cmd = services["router-1"]["command"]
        assert cmd[cmd.index("--http-port" if port == 8000 else "--extproc-port") + 1] == str(port)
    listeners = {x["name"]: x for x in envoy["static_resources"]["listeners"]}
    hcm = listeners["kvmesh-routers"]["filter_chains"][0]["filters"][0]["typed_config"]
    (route,) = hcm["route_config"]["virtual_hosts"][0]["routes"]
    retry = route["route"]["retry_policy"]
    assert {"connect-failure", "refused-stream", "reset"} <= set(retry["retry_on"].split(","))
    assert retry["num_retries"] >= 1 and retry["per_try_timeout"]
    hcm = listeners["kvmesh-gateway"]["filter_chains"][0]["filters"][0]["typed_config"]
    (ext,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    assert "connect-failure" in ext["typed_config"]["grpc_service"]["retry_policy"]["retry_on"]


def test_mounted_config_files_exist(base: dict[str, Any]) -> None:
    for name, svc in base["services"].items():
        for vol in svc.get("volumes", []):
            source = vol.split(":")[0] if isinstance(vol, str) else vol.get("source", "")
            if source.startswith(("/", ".")):   # a bind mount, not a named volume
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"


def test_prometheus_scrapes_every_kvmesh_service(base: dict[str, Any]) -> None:
    prom = yaml.safe_load((ROOT / "deploy" / "compose" / "prometheus.yml").read_text())
    targets = {t.split(":")[0] for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert KVMESH <= targets
    for name in KVMESH:
        cmd = base["services"][name]["command"]
        assert cmd[cmd.index("--metrics-port") + 1] == "9100", name


def test_gpu_override_switches_workers_to_vllm(base: dict[str, Any], gpu: dict[str, Any]) -> None:
    for w in WORKERS:
        sim, real = base["services"][w], gpu["services"][w]
        assert sim["command"][sim["command"].index("--engine") + 1] == "sim"
        assert real["command"][real["command"].index("--engine") + 1] == "vllm"
        assert real["build"]["args"]["ENGINE"] == "vllm"
        (dev,) = real["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"] and dev["count"] == 1
        assert "deploy" not in sim
    # the rest of the stack is untouched by the override
    assert gpu["services"]["indexer"] == base["services"]["indexer"]


def test_services_listen_on_every_interface_in_the_stack(base: dict[str, Any], gpu: dict[str, Any]) -> None:
    """Services bind loopback by default (issue #20); in compose each one is told otherwise."""
    for name in KVMESH:
        cmd = base["services"][name]["command"]
        assert cmd[cmd.index("--host") + 1] == "0.0.0.0", name
    for name, svc in gpu["services"].items():
        if "command" in svc and "--port" in svc["command"]:
            assert svc["command"][svc["command"].index("--host") + 1] == "0.0.0.0", name
    offload = base["services"]["offload"]["command"]
    assert offload[offload.index("--bulk-port") + 1].isdigit()   # a fixed port a firewall can name


def _arg(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_external_vllm_example_is_consistent() -> None:
    """docs/vllm-external.md's compose example (no Docker engine here: ``docker-compose config``
    merges and validates it): every vLLM container publishes to the indexer's central socket under
    the id the routers give its URL, hashes as the routers and the indexer's model do, saves to
    the store the stack runs, and presents a certificate certs-init issues."""
    cfg = compose_config(BASE, EXTERNAL)
    services = cfg["services"]
    indexer = services["indexer"]["command"]
    bind_port = _arg(indexer, "--kv-events-bind").rsplit(":", 1)[1]
    replay = _arg(indexer, "--kv-events-replay")
    models = {m.split("@")[0]: m.split("@")[1:] for m in _arg(indexer, "--models").split(",")}
    offload = services["offload"]["command"]
    certs = services["certs-init"]["entrypoint"][-1]
    version = kvmesh.__version__   # the connector wheel's version (packaging/kvmesh-connector)
    vllms = sorted(n for n, svc in services.items() if svc.get("image", "").startswith("vllm/vllm-openai"))
    assert vllms == ["vllm-1", "vllm-2"]
    ids = set()
    for name in vllms:
        svc = services[name]
        cmd = svc["command"]
        served, port = _arg(cmd, "--served-model-name"), _arg(cmd, "--port")
        events = json.loads(_arg(cmd, "--kv-events-config"))
        assert events["publisher"] == "zmq" and events["endpoint"] == f"tcp://indexer:{bind_port}"
        assert events["topic"] == f"kv@{name}:{port}@{served}"
        assert replay.format(host=name) == events["replay_endpoint"].replace("*", name)
        assert models[served] == [_arg(cmd, "--block-size"), _arg(cmd, "--prefix-caching-hash-algo")]
        ids.add(f"{name}:{port}")
        kvt = json.loads(_arg(cmd, "--kv-transfer-config"))
        assert kvt["kv_connector"] == "KvmeshConnector"
        assert kvt["kv_connector_extra_config"]["store_address"] == f"offload:{_arg(offload, '--port')}"
        assert svc["depends_on"]["offload"]["condition"] == "service_healthy"
        cert = svc["environment"]["KVMESH_TLS_CERT"]
        role, ident = cert.removeprefix("/certs/").removesuffix(".pem").split("-", 1)
        assert f"--identity {role}/{ident}" in certs, cert
        # The connector wheel `make connector-wheel` builds, mounted and installed at start.
        assert f"{ROOT}/dist:/wheels:ro" in svc["volumes"]
        assert f"/wheels/kvmesh_connector-{version}-py3-none-any.whl" in svc["entrypoint"][-2]
    assert _arg(offload, "--model") == "any"   # stores the vLLM containers' KV too
    for r in ROUTERS:
        cmd = services[r]["command"]
        served = _arg(cmd, "--model")
        assert served in models and [_arg(cmd, "--block-size"), _arg(cmd, "--hash-algo")] == models[served]
        urls = _arg(cmd, "--endpoints").split(",")
        assert {u.removeprefix("http://") for u in urls} == ids
        assert all(services[r]["depends_on"][v]["condition"] == "service_healthy" for v in vllms)


TOKEN = "/metrics-auth/token"


def _mounts(svc: dict[str, Any]) -> dict[str, str]:
    out = {}
    for vol in svc.get("volumes", []):
        if isinstance(vol, str):
            src, dst = vol.split(":")[:2]
        else:
            src, dst = vol.get("source", ""), vol["target"]
        out[dst] = src
    return out


@pytest.mark.parametrize("files", [(BASE,), (BASE, GPU), (BASE, EXTERNAL)], ids=["base", "gpu", "vllm-external"])
def test_metrics_need_a_token_and_prometheus_sends_it(files: tuple[Path, ...]) -> None:
    """Every kvmesh service's /metrics takes the token certs-init writes (a scrape without it is
    401, tests/security/test_http_mtls.py), and Prometheus's kvmesh jobs send that same file."""
    cfg = compose_config(*files)
    init = cfg["services"]["certs-init"]
    assert "/metrics-auth" in _mounts(init) and TOKEN in " ".join(init["entrypoint"])
    prefix = {"router-1": "ROUTER", "router-2": "ROUTER", "indexer": "INDEXER", "offload": "OFFLOAD"}
    for name in KVMESH:
        svc = cfg["services"][name]
        env = svc.get("environment", {})
        assert env.get(f"KVMESH_{prefix.get(name, 'WORKER')}_METRICS_TOKEN_FILE") == TOKEN, name
        assert _mounts(svc).get("/metrics-auth") == "metrics-auth", name
    prom_svc = cfg["services"]["prometheus"]
    assert _mounts(prom_svc).get("/metrics-auth") == "metrics-auth"
    prom = yaml.safe_load((ROOT / "deploy" / "compose" / "prometheus.yml").read_text())
    for job in prom["scrape_configs"]:
        if job["job_name"].startswith("kvmesh-"):
            assert job["authorization"] == {"type": "Bearer", "credentials_file": TOKEN}, job["job_name"]


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose.vllm-external.yml"])
def test_the_store_publishes_a_replay_socket(name: str) -> None:
    # Without one, an indexer that lost the store's batches (a Redis timeout) clears its blocks
    # from the index, and every restore is mispredicted for minutes (the 30-minute soak).
    cmd = yaml.safe_load((ROOT / name).read_text())["services"]["offload"]["command"]
    assert _arg(cmd, "--events-replay-endpoint") == "tcp://*:5558"
