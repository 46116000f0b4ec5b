"""A Kubernetes API server for EndpointSlices over real HTTPS on loopback, for a router
running in a container with the in-cluster configuration the kubelet gives a pod: the
service account's token and CA under /var/run/secrets/kubernetes.io/serviceaccount and
KUBERNETES_SERVICE_HOST/PORT. It serves what the router's discovery calls (list, and
watch as chunked JSON lines) and refuses a request without the pod's bearer token (401).

The test plays the EndpointSlice controller: `set_ready(service, ready)` marks the one
endpoint of a Service's slice ready or not, as a pod's readiness probe makes it, and every
open watch gets a MODIFIED event.
"""
from __future__ import annotations

import json
import ssl
import threading
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from tests.services.security.certs import make_certs

PREFIX = "/apis/discovery.k8s.io/v1/namespaces/"


@dataclass
class Slice:
    service: str
    port: int
    ready: bool = False


@dataclass(frozen=True)
class ServiceAccount:
    """The files the kubelet mounts at /var/run/secrets/kubernetes.io/serviceaccount."""
    folder: Path
    token: str


class EndpointSliceServer:
    def __init__(self, namespace: str, folder: Path, address: str = "127.0.0.1"):
        self.namespace = namespace
        folder.mkdir(parents=True, exist_ok=True)
        certs = make_certs(folder)
        self.account = ServiceAccount(folder / "serviceaccount", "pod-token-" + folder.name)
        self.account.folder.mkdir()
        (self.account.folder / "token").write_text(self.account.token)
        (self.account.folder / "ca.crt").write_text(Path(certs.ca).read_text())
        (self.account.folder / "namespace").write_text(namespace)
        for f in self.account.folder.iterdir():
            f.chmod(0o644)
        self._slices: dict[str, Slice] = {}
        self._version = 1
        self._changed = threading.Condition()
        self.requests: list[tuple[str, int]] = []   # (path, status) of every request answered
        self._httpd = ThreadingHTTPServer((address, 0), _handler(self))
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(certs.cert, certs.key)
        self._httpd.socket = context.wrap_socket(self._httpd.socket, server_side=True)
        self._httpd.daemon_threads = True
        self.host, self.port = address, self._httpd.server_address[1]
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    def add_service(self, service: str, port: int) -> None:
        with self._changed:
            self._slices[service] = Slice(service, port)
            self._bump()

    def set_ready(self, service: str, ready: bool) -> None:
        with self._changed:
            if self._slices[service].ready != ready:
                self._slices[service].ready = ready
                self._bump()

    def close(self) -> None:
        with self._changed:
            self._version = -1   # ends every watch
            self._changed.notify_all()
        self._httpd.shutdown()
        self._httpd.server_close()

    def _bump(self) -> None:
        self._version += 1
        self._changed.notify_all()

    def _object(self, s: Slice) -> dict:
        return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": f"{s.service}-abcde", "namespace": self.namespace,
                             "resourceVersion": str(self._version),
                             "labels": {"kubernetes.io/service-name": s.service}},
                "addressType": "IPv4", "ports": [{"name": "grpc", "port": s.port, "protocol": "TCP"}],
                "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": s.ready, "serving": s.ready},
                               "targetRef": {"kind": "Pod", "name": f"{s.service}-pod", "namespace": self.namespace}}]}

    def _matching(self, selector: str) -> list[Slice]:
        wanted = dict(term.split("=", 1) for term in filter(None, selector.split(",")))
        return [s for s in self._slices.values()
                if all({"kubernetes.io/service-name": s.service}.get(k) == v for k, v in wanted.items())]


def _handler(server: EndpointSliceServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # the test reads `server.requests` instead
            pass

        def do_GET(self) -> None:
            url = urlparse(self.path)
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
            if scheme.lower() != "bearer" or token != server.account.token:   # the client sends "bearer"
                return self._send(HTTPStatus.UNAUTHORIZED, {"kind": "Status", "code": 401, "reason": "Unauthorized"})
            if url.path != f"{PREFIX}{server.namespace}/endpointslices":
                return self._send(HTTPStatus.NOT_FOUND, {"kind": "Status", "code": 404})
            if query.get("watch") in ("true", "1"):
                return self._watch(query)
            with server._changed:
                items = [server._object(s) for s in server._matching(query.get("labelSelector", ""))]
                body = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                        "metadata": {"resourceVersion": str(server._version)}, "items": items}
            self._send(HTTPStatus.OK, body)

        def _send(self, status: HTTPStatus, body: dict) -> None:
            data = json.dumps(body).encode()
            server.requests.append((self.path, int(status)))
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _watch(self, query: dict) -> None:
            server.requests.append((self.path, 200))
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            seen = int(query.get("resourceVersion") or 0)
            timeout_s = float(query.get("timeoutSeconds") or 300)
            try:
                while True:
                    with server._changed:
                        if server._version == seen or server._version < 0:
                            server._changed.wait(timeout_s)
                        if server._version < 0 or server._version == seen:
                            break     # closed, or the watch's timeout ran out: the client lists again
                        seen = server._version
                        events = [server._object(s) for s in server._matching(query.get("labelSelector", ""))]
                    for obj in events:
                        self._chunk(json.dumps({"type": "MODIFIED", "object": obj}).encode() + b"\n")
                self._chunk(b"")
            except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
                pass

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    return Handler
