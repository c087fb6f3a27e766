"""A stand-in for the Kubernetes API's EndpointSlice endpoints (no cluster can run in tests).

Serves ``GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices`` the way the API server
does for the ``kubernetes`` client: a list with a ``resourceVersion``, and with ``watch=true`` a
stream of JSON lines ``{"type": ADDED|MODIFIED|DELETED|ERROR, "object": ...}`` after the given
version, closed after ``timeoutSeconds``. Equality label selectors are honoured. ``expire()`` makes
every version so far too old, so a watch from one gets ``410 Gone`` (the client must list again).
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

_PATH = re.compile(r"^/apis/discovery\.k8s\.io/v1/namespaces/([^/]+)/endpointslices$")


def endpoint_slice(name: str, labels: dict[str, str], addresses: list[str], port: int,
                   ready: bool = True) -> dict:
    """An EndpointSlice object (one port named grpc, one endpoint per address)."""
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "labels": dict(labels)}, "addressType": "IPv4",
            "ports": [{"name": "grpc", "port": port, "protocol": "TCP"}],
            "endpoints": [{"addresses": [a], "conditions": {"ready": ready}} for a in addresses]}


def _matches(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        else:
            k, v = re.split(r"==?", term, maxsplit=1)
            if labels.get(k.strip()) != v.strip():
                return False
    return True


class FakeKubeAPI:
    """EndpointSlices of one namespace, changed by the test while clients list and watch."""

    def __init__(self, namespace: str = "serving") -> None:
        self.namespace = namespace
        self.slices: dict[str, dict] = {}
        self.version = 1
        self.oldest = 0  # watches from a version below this get 410 Gone
        self.events: list[tuple[int, str, dict]] = []
        self.requests: list[dict[str, list[str]]] = []
        self._cond = threading.Condition()
        self._closed = False
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # watches are chunked, as the API server's are

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                m = _PATH.match(url.path)
                if not m or m.group(1) != api.namespace:
                    self.send_error(404)
                    return
                q = parse_qs(url.query)
                api.requests.append(q)
                selector = q.get("labelSelector", [""])[0]
                if q.get("watch", ["false"])[0] in ("true", "1"):
                    api._watch(self, selector, int(q.get("resourceVersion", ["0"])[0] or 0),
                               float(q.get("timeoutSeconds", ["300"])[0]))
                else:
                    api._list(self, selector)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    # ---- the test's side -------------------------------------------------------------------------
    def put(self, obj: dict) -> None:
        """Create or replace a slice (ADDED or MODIFIED)."""
        with self._cond:
            name = obj["metadata"]["name"]
            kind = "MODIFIED" if name in self.slices else "ADDED"
            self._record(kind, obj)
            self.slices[name] = self.events[-1][2]

    def delete(self, name: str) -> None:
        with self._cond:
            self._record("DELETED", self.slices.pop(name))

    def expire(self) -> None:
        """Versions so far are compacted away: watches from them get 410 Gone."""
        with self._cond:
            self.oldest = self.version + 1
            self.version += 1
            self._cond.notify_all()

    def watches(self) -> int:
        return sum(1 for q in self.requests if q.get("watch") == ["true"])

    def lists(self) -> int:
        return len(self.requests) - self.watches()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.server.shutdown()
        self.server.server_close()

    # ---- serving ---------------------------------------------------------------------------------
    def _record(self, kind: str, obj: dict) -> None:
        self.version += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.version)
        obj["metadata"]["namespace"] = self.namespace
        self.events.append((self.version, kind, obj))
        self._cond.notify_all()

    def _list(self, h: BaseHTTPRequestHandler, selector: str) -> None:
        with self._cond:
            items = [s for s in self.slices.values()
                     if _matches(selector, s["metadata"].get("labels") or {})]
            body = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                    "metadata": {"resourceVersion": str(self.version)}, "items": items}
        data = json.dumps(body).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _watch(self, h: BaseHTTPRequestHandler, selector: str, since: int, timeout_s: float) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.send_header("Connection", "close")
        h.end_headers()
        h.close_connection = True

        def send(event: dict) -> None:
            data = (json.dumps(event) + "\n").encode()
            h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            h.wfile.flush()

        end = time.monotonic() + timeout_s
        try:
            self._stream(send, selector, since, end)
            h.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _stream(self, send, selector: str, since: int, end: float) -> None:
        with self._cond:
            if since < self.oldest:
                status = {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                          "reason": "Expired", "code": 410,
                          "message": f"too old resource version: {since} ({self.oldest})"}
                send({"type": "ERROR", "object": status})
                return
            while not self._closed and time.monotonic() < end:
                if since < self.oldest:
                    return  # compacted while watching: the client re-watches and gets 410
                for version, kind, obj in self.events:
                    if version > since and _matches(selector, obj["metadata"].get("labels") or {}):
                        send({"type": kind, "object": obj})
                since = max(since, self.version)
                self._cond.wait(min(0.5, max(0.0, end - time.monotonic())))
