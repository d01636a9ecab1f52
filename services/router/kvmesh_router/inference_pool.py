"""External endpoints discovered from a Gateway API ``InferencePool`` (``--inference-pool NS/NAME``).

A team that already runs vLLM behind a Gateway API Inference Extension gateway has
declared its engines as an ``InferencePool``: a pod selector and target ports. The
router reads the pool and watches the pods it selects with the official
``kubernetes`` client, so pods that scale up, go unready or die join and leave the
routable set as the gateway's own picker would see them. Every (ready pod, target
port) is one external OpenAI endpoint ``<pod-ip>:<port>`` at ``http://<pod-ip>:<port>``;
the id is the one llm-d's event topic carries (``kv@<pod-ip>:<port>@<model>``), so
the indexer's events and the router's endpoints agree without configuration.

The pool's ``InferenceObjective`` objects (``spec.poolRef`` naming the pool) give the
priorities the gateway path sheds by (``picker``); they are listed again at every relist.

Both pool API versions are read: ``inference.networking.k8s.io/v1`` (``selector.matchLabels``,
``targetPorts[].number``) and ``inference.networking.x-k8s.io/v1alpha2`` (``selector`` map,
``targetPortNumber``). The client is blocking, so the list-then-watch loop runs in a
thread and hands whole snapshots to the event loop; an expired watch (410) or any
API error relists after a pause, re-reading the pool in case its selector changed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

POOL_APIS = (("inference.networking.k8s.io", "v1"), ("inference.networking.x-k8s.io", "v1alpha2"))
OBJECTIVE_APIS = (("inference.networking.x-k8s.io", "v1alpha2"), ("llm-d.ai", "v1alpha2"))


@dataclass(frozen=True)
class PoolSpec:
    label_selector: str      # "k=v,k2=v2", as the pods API takes it
    ports: tuple[int, ...]


def pool_spec(obj: dict[str, Any]) -> PoolSpec:
    """Selector and ports of an InferencePool object (v1 or v1alpha2); ValueError if unusable."""
    spec = obj.get("spec") or {}
    sel = spec.get("selector") or {}
    labels = sel.get("matchLabels", sel) if isinstance(sel, dict) else {}
    if not isinstance(labels, dict) or not labels or not all(isinstance(v, str) for v in labels.values()):
        raise ValueError("the pool has no selector labels (matchExpressions are not supported)")
    ports = [p.get("number") for p in spec.get("targetPorts") or [] if isinstance(p, dict)]
    if not ports and spec.get("targetPortNumber") is not None:
        ports = [spec["targetPortNumber"]]
    if not ports or not all(isinstance(p, int) and 0 < p < 65536 for p in ports):
        raise ValueError("the pool has no valid target ports")
    return PoolSpec(",".join(f"{k}={v}" for k, v in sorted(labels.items())), tuple(ports))


def objective_priorities(items: list[dict[str, Any]], pool: str) -> dict[str, int]:
    """InferenceObjective name -> priority (unset: 0) of the objectives whose poolRef is ``pool``."""
    out = {}
    for obj in items:
        spec = obj.get("spec") or {}
        ref = spec.get("poolRef") or {}
        name = (obj.get("metadata") or {}).get("name")
        prio = spec.get("priority", 0)
        if ref.get("name") == pool and isinstance(name, str) and isinstance(prio, int) and not isinstance(prio, bool):
            out[name] = prio
    return out


def pod_ready(pod: Any) -> bool:
    st = pod.status
    if pod.metadata.deletion_timestamp is not None or st is None or not st.pod_ip or st.phase != "Running":
        return False
    return any(c.type == "Ready" and c.status == "True" for c in st.conditions or [])


def endpoints_of(pods: dict[str, Any], ports: tuple[int, ...]) -> dict[str, str]:
    """Endpoint id -> base URL for every ready pod and target port."""
    out = {}
    for pod in pods.values():
        if pod_ready(pod):
            for port in ports:
                out[f"{pod.status.pod_ip}:{port}"] = f"http://{pod.status.pod_ip}:{port}"
    return out


class InferencePoolWatcher:
    """Keeps ``apply(snapshot)`` called (on the event loop) with the pool's endpoints."""

    def __init__(self, namespace: str, name: str, apply: Callable[[dict[str, str]], None], kubeconfig: str = "",
                 retry_s: float = 2.0, watch_timeout_s: int = 60,
                 objectives: Callable[[dict[str, int]], None] | None = None) -> None:
        self.namespace, self.name = namespace, name
        self._apply = apply
        self._objectives = objectives
        self.kubeconfig = kubeconfig
        self.retry_s = retry_s
        self.watch_timeout_s = watch_timeout_s
        self._stop = threading.Event()
        self._watch: Any = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.synced = asyncio.Event()   # set after the first snapshot was applied

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="inference-pool-watch", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        if self._thread is not None:
            # The watch's stream returns at its next event or timeout; don't wait for that.
            await asyncio.to_thread(self._thread.join, 2.0)

    # -- the watch thread
    def _client(self) -> Any:
        from kubernetes import client, config

        cfg = client.Configuration()
        if self.kubeconfig:
            config.load_kube_config(config_file=self.kubeconfig, client_configuration=cfg)
        else:
            try:
                config.load_incluster_config(client_configuration=cfg)
            except config.ConfigException:
                config.load_kube_config(client_configuration=cfg)
        return client.ApiClient(cfg)

    def _read_pool(self, api: Any) -> PoolSpec:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        objs = client.CustomObjectsApi(api)
        err: Exception | None = None
        for group, version in POOL_APIS:
            try:
                obj = objs.get_namespaced_custom_object(group, version, self.namespace, "inferencepools", self.name)
            except ApiException as exc:
                if exc.status != 404:
                    raise
                err = exc
                continue
            return pool_spec(obj)
        raise LookupError(f"InferencePool {self.namespace}/{self.name} not found ({err and err.reason})")

    def _read_objectives(self, api: Any) -> None:
        """Hand the pool's objective priorities over; an API without the CRD leaves them as they were."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        if self._objectives is None:
            return
        objs = client.CustomObjectsApi(api)
        for group, version in OBJECTIVE_APIS:
            try:
                got = objs.list_namespaced_custom_object(group, version, self.namespace, "inferenceobjectives")
            except ApiException as exc:
                if exc.status == 404:
                    continue
                raise
            prios = objective_priorities(got.get("items") or [], self.name)
            if self._loop is not None and not self._stop.is_set():
                self._loop.call_soon_threadsafe(self._objectives, prios)
            return

    def _post(self, pods: dict[str, Any], ports: tuple[int, ...]) -> None:
        snap = endpoints_of(pods, ports)
        if self._loop is not None and not self._stop.is_set():
            self._loop.call_soon_threadsafe(self._deliver, snap)

    def _deliver(self, snap: dict[str, str]) -> None:
        self._apply(snap)
        self.synced.set()

    def _run(self) -> None:
        from kubernetes import client, watch
        from kubernetes.client.exceptions import ApiException

        api = None
        while not self._stop.is_set():
            try:
                if api is None:
                    api = self._client()
                spec = self._read_pool(api)
                self._read_objectives(api)
                core = client.CoreV1Api(api)
                listed = core.list_namespaced_pod(self.namespace, label_selector=spec.label_selector)
                pods = {p.metadata.name: p for p in listed.items}
                self._post(pods, spec.ports)
                rv = listed.metadata.resource_version
                self._watch = watch.Watch()
                for ev in self._watch.stream(core.list_namespaced_pod, self.namespace,
                                             label_selector=spec.label_selector, resource_version=rv,
                                             timeout_seconds=self.watch_timeout_s):
                    if self._stop.is_set():
                        return
                    kind, pod = ev["type"], ev["object"]
                    if kind == "ERROR" or not hasattr(pod, "metadata"):
                        break   # e.g. 410 Gone: the resource version expired; relist
                    if kind == "DELETED":
                        pods.pop(pod.metadata.name, None)
                    else:
                        pods[pod.metadata.name] = pod
                    self._post(pods, spec.ports)
                continue   # the watch timed out: relist (and re-read the pool)
            except ApiException as exc:
                if exc.status == 410:
                    continue
                log.warning("InferencePool watch failed; retrying",
                            extra={"pool": f"{self.namespace}/{self.name}", "status": exc.status,
                                   "reason": exc.reason})
            except Exception as exc:  # noqa: BLE001 - API server down, bad pool: keep the last endpoints, retry
                log.warning("InferencePool watch failed; retrying",
                            extra={"pool": f"{self.namespace}/{self.name}", "error": str(exc)})
            self._stop.wait(self.retry_s)
