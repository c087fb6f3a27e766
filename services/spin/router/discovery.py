"""Where the drafter and verifier replicas are: static addresses, or the Kubernetes API.

In a cluster every drafter Deployment and the verifier Deployment have a Service labelled
``spin.dev/role: drafter|verifier`` (drafters also ``spin.dev/drafter: <name>``). Kubernetes copies
a Service's labels onto its EndpointSlices, so the router watches EndpointSlices in its namespace
with a label selector (``app.kubernetes.io/instance=<release>``) and learns every ready pod's
address and the port named ``grpc``. Pods coming, going and being replaced change the pools'
replicas (``pool.py``), which keep each request pinned to the replica holding its cache.

The ``kubernetes`` client is synchronous: the watch runs in a daemon thread and hands each new
picture of the endpoints to the event loop. It needs RBAC ``list`` and ``watch`` on
``discovery.k8s.io/endpointslices`` in the namespace, nothing else.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
ROLE_LABEL = "spin.dev/role"
DRAFTER_LABEL = "spin.dev/drafter"
PORT_NAME = "grpc"
_SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


@dataclass
class Endpoints:
    """Ready replica addresses (host:port) per service."""

    verifier: set[str] = field(default_factory=set)
    drafters: dict[str, set[str]] = field(default_factory=dict)


@dataclass
class KubernetesDiscoveryConfig:
    """How the router watches EndpointSlices."""

    label_selector: str
    """Selects this release's drafter and verifier Services' EndpointSlices, e.g.
    ``app.kubernetes.io/instance=spin``."""
    namespace: str | None = None
    """Namespace to watch; None = $POD_NAMESPACE, else the service account's namespace."""
    api_url: str | None = None
    """API server URL without credentials (``kubectl proxy``, or a stand-in in tests); None = the
    in-cluster config (service account token)."""
    watch_timeout_s: int = 300
    """The server ends each watch after this long; the router then lists afresh (self-healing)."""
    retry_s: float = 2.0
    """Pause after a failed list or watch before trying again."""


def default_namespace() -> str:
    ns = os.environ.get("POD_NAMESPACE")
    if ns:
        return ns
    if _SA_NAMESPACE.exists():
        return _SA_NAMESPACE.read_text().strip()
    return "default"


def endpoints_from_slices(slices: list[dict[str, Any]]) -> Endpoints:
    """The ready addresses in EndpointSlices (API dicts, camelCase as served)."""
    out = Endpoints()
    for s in slices:
        labels = (s.get("metadata") or {}).get("labels") or {}
        role = labels.get(ROLE_LABEL)
        ports = s.get("ports") or []
        port = next((p.get("port") for p in ports if p.get("name") == PORT_NAME),
                    ports[0].get("port") if len(ports) == 1 else None)
        if role not in ("drafter", "verifier") or port is None:
            continue
        addrs: set[str] = set()
        for ep in s.get("endpoints") or []:
            if (ep.get("conditions") or {}).get("ready") is False:
                continue  # not ready or terminating: no new work (its requests move on)
            for a in ep.get("addresses") or []:
                addrs.add(f"[{a}]:{port}" if ":" in a else f"{a}:{port}")
        if role == "verifier":
            out.verifier |= addrs
        elif labels.get(DRAFTER_LABEL):
            out.drafters.setdefault(labels[DRAFTER_LABEL], set()).update(addrs)
    return out


class KubernetesDiscovery:
    """Watches EndpointSlices in a thread; calls ``on_change(Endpoints)`` on the event loop."""

    def __init__(self, cfg: KubernetesDiscoveryConfig,
                 on_change: Callable[[Endpoints], None]) -> None:
        from kubernetes import client, config

        self.cfg = cfg
        self.namespace = cfg.namespace or default_namespace()
        if cfg.api_url:
            conf = client.Configuration(host=cfg.api_url)
        else:
            conf = client.Configuration()
            config.load_incluster_config(client_configuration=conf)
        self.api = client.DiscoveryV1Api(client.ApiClient(conf))
        self.on_change = on_change
        self._slices: dict[str, dict[str, Any]] = {}
        self._last: Endpoints | None = None
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.lists = 0
        """Full lists so far (the first, then one after every watch ends or fails)."""

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="endpointslice-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.rest import ApiException

        sel, ns = self.cfg.label_selector, self.namespace
        while not self._stop.is_set():
            try:
                listed = self.api.list_namespaced_endpoint_slice(
                    ns, label_selector=sel, _preload_content=False, _request_timeout=30)
                body = _json(listed)
                self.lists += 1
                self._slices = {s["metadata"]["name"]: s for s in body.get("items") or []}
                self._publish()
                w = watch.Watch()
                for event in w.stream(self.api.list_namespaced_endpoint_slice, ns,
                                      label_selector=sel,
                                      resource_version=body["metadata"].get("resourceVersion"),
                                      timeout_seconds=self.cfg.watch_timeout_s,
                                      allow_watch_bookmarks=True,
                                      _request_timeout=self.cfg.watch_timeout_s + 30):
                    if self._stop.is_set():
                        w.stop()
                        break
                    self._event(event)
            except ApiException as e:
                if e.status != 410:  # 410 Gone: our resourceVersion expired; list again now
                    log.warning("EndpointSlice watch in %s failed: %s %s", ns, e.status, e.reason)
                    self._stop.wait(self.cfg.retry_s)
            except Exception as e:  # noqa: BLE001 - the API server restarts, the network blips
                log.warning("EndpointSlice watch in %s failed: %s", ns, e)
                self._stop.wait(self.cfg.retry_s)

    def _event(self, event: dict[str, Any]) -> None:
        kind, obj = event.get("type"), event.get("raw_object") or {}  # as served (camelCase)
        name = (obj.get("metadata") or {}).get("name")
        if kind in ("ADDED", "MODIFIED") and name:
            self._slices[name] = obj
        elif kind == "DELETED" and name:
            self._slices.pop(name, None)
        else:
            return  # BOOKMARK
        self._publish()

    def _publish(self) -> None:
        eps = endpoints_from_slices(list(self._slices.values()))
        if eps == self._last or self._loop is None:
            return
        self._last = eps
        log.info("discovered verifier %s, drafters %s", sorted(eps.verifier),
                 {n: sorted(a) for n, a in sorted(eps.drafters.items())})
        self._loop.call_soon_threadsafe(self.on_change, eps)


def _json(resp) -> dict[str, Any]:
    try:
        return json.loads(resp.data)
    finally:
        resp.release_conn()
