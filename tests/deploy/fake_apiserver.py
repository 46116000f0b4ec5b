"""A scripted Kubernetes API server for EndpointSlices, under a real `kubernetes` client.

It takes the place of urllib3's PoolManager inside a real ApiClient: the real
DiscoveryV1Api builds the requests and the real Watch parses the answers, exactly as
against a cluster; only the sockets are missing. The test drives it:

    server.put_slice(...)        change a slice; open watches matching it get ADDED/MODIFIED
    server.delete_slice(name)    ... DELETED
    server.put_slice(..., silent=True)   change it with no event (only a re-list sees it)
    server.expire_watches()      ERROR 410 Gone on every open watch (history compacted)
    server.end_watches()         close every watch normally (its timeoutSeconds ran out)
    server.bookmark()            a BOOKMARK on every open watch
    server.fail_lists(503, n)    answer the next n lists with that HTTP status
    server.stop_failing_lists()

Watches are HTTP/1.1 chunked streams of JSON lines, one event per line.
"""
from __future__ import annotations

import json
import queue
import threading
import time
from http import HTTPStatus
from urllib.parse import parse_qs, urlparse

from kubernetes import client
from urllib3 import HTTPHeaderDict

_PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"


def endpoint_slice(name: str, service: str, endpoints: list[tuple],
                   port: int = 50070, port_name: str = "grpc", address_type: str = "IPv4") -> dict:
    """An EndpointSlice as the API serves it. endpoints: (ip, ready[, terminating]);
    ready None leaves the condition out (the API: unknown means ready)."""
    eps = []
    for ip, ready, *rest in endpoints:
        conditions = {} if ready is None else {"ready": ready, "serving": ready}
        if rest:
            conditions["terminating"] = rest[0]
        eps.append({"addresses": [ip], "conditions": conditions,
                    "targetRef": {"kind": "Pod", "name": f"pod-{ip}", "namespace": "llm"}})
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": "llm", "labels": {"kubernetes.io/service-name": service}},
            "addressType": address_type, "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
            "endpoints": eps}


def _matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality-based label selectors (k=v,k2=v2), what the router is configured with."""
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key.strip()) != value.strip():
            return False
    return True


class _Socket:
    def __init__(self, on_shutdown):
        self._on_shutdown = on_shutdown

    def shutdown(self, how) -> None:  # what Watch.stop() calls to unblock a read
        self._on_shutdown()


class _Connection:
    def __init__(self, sock: _Socket):
        self.sock = sock


class FakeResponse:
    """The parts of urllib3.HTTPResponse that the kubernetes client uses."""

    def __init__(self, status: int, body: bytes = b"", stream: queue.Queue | None = None):
        self.status = status
        self.reason = HTTPStatus(status).phrase
        self.headers = HTTPHeaderDict({"content-type": "application/json"})
        self.data = body
        self._stream = stream
        self.connection = None

    def stream(self, amt=None, decode_content=None):
        if self._stream is None:
            yield self.data
            return
        while (chunk := self._stream.get()) is not None:
            yield chunk

    def read(self, *args, **kwargs) -> bytes:
        return self.data

    def getheaders(self):
        return self.headers

    def close(self) -> None:
        pass

    def release_conn(self) -> None:
        pass


class _Watch:
    def __init__(self, selector: str, resource_version: str, timeout_seconds: str):
        self.selector, self.resource_version, self.timeout_seconds = selector, resource_version, timeout_seconds
        self.chunks: queue.Queue = queue.Queue()
        self.response = FakeResponse(200, stream=self.chunks)
        self.response.connection = _Connection(_Socket(self.end))
        self.open = True

    def send(self, event_type: str, obj: dict) -> None:
        # split mid-line on purpose: the client must reassemble lines across chunks
        line = json.dumps({"type": event_type, "object": obj}).encode() + b"\n"
        self.chunks.put(line[:7])
        self.chunks.put(line[7:])

    def end(self) -> None:
        self.open = False
        self.chunks.put(None)


class FakeApiServer:
    def __init__(self, namespace: str = "llm"):
        self.namespace = namespace
        self.requests: list[tuple[str, dict[str, str]]] = []  # (path, query) of each call
        self._slices: dict[str, dict] = {}
        self._version = 100
        self._watches: list[_Watch] = []
        self._list_failures: list[int] = []
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)

    # the test's side

    def api(self) -> client.DiscoveryV1Api:
        """A real DiscoveryV1Api whose HTTP goes to this server."""
        api_client = client.ApiClient(client.Configuration(host="https://fake-apiserver"))
        api_client.rest_client.pool_manager = self
        return client.DiscoveryV1Api(api_client)

    def put_slice(self, obj: dict, silent: bool = False) -> None:
        with self._lock:
            name = obj["metadata"]["name"]
            kind = "MODIFIED" if name in self._slices else "ADDED"
            obj = self._stamp(obj)
            self._slices[name] = obj
            if not silent:
                self._send(kind, obj)

    def delete_slice(self, name: str) -> None:
        with self._lock:
            obj = self._stamp(self._slices.pop(name))
            self._send("DELETED", obj)

    def expire_watches(self) -> None:
        status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                  "message": "too old resource version", "reason": "Expired", "code": 410}
        with self._lock:
            for w in self._open_watches():
                w.send("ERROR", status)
                w.end()

    def end_watches(self) -> None:
        with self._lock:
            for w in self._open_watches():
                w.end()

    def bookmark(self) -> None:
        with self._lock:
            self._version += 1
            for w in self._open_watches():
                w.send("BOOKMARK", {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
                                    "metadata": {"resourceVersion": str(self._version)}})

    def fail_lists(self, status: int, times: int) -> None:
        with self._lock:
            self._list_failures += [status] * times

    def stop_failing_lists(self) -> None:
        with self._lock:
            self._list_failures.clear()

    def num_lists(self) -> int:
        return sum(1 for _, q in self.requests if q.get("watch") != "true")

    def wait_for_watches(self, count: int, timeout: float = 5.0) -> list[_Watch]:
        """Until `count` watches are open (both pools watching, typically)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while len(self._open_watches()) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(self._open_watches())} watches open, wanted {count}")
                self._changed.wait(left)
            return self._open_watches()

    def close(self) -> None:
        self.end_watches()

    # the client's side: urllib3.PoolManager.request

    def request(self, method, url, fields=None, timeout=None, headers=None, preload_content=True, **kwargs):
        parsed = urlparse(url)
        query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
        query = {k: v.lower() if v in ("True", "False") else v for k, v in query.items()}
        with self._changed:
            self.requests.append((parsed.path, query))
            if method != "GET" or parsed.path != _PATH.format(namespace=self.namespace):
                return FakeResponse(404, b'{"kind":"Status","code":404}')
            if query.get("watch") == "true":
                return self._open_watch(query)
            return self._list(query)

    def _list(self, query: dict[str, str]) -> FakeResponse:
        if self._list_failures:
            status = self._list_failures.pop(0)
            return FakeResponse(status, json.dumps({"kind": "Status", "code": status}).encode())
        items = [s for s in self._slices.values()
                 if _matches(query.get("labelSelector", ""), s["metadata"]["labels"])]
        body = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                "metadata": {"resourceVersion": str(self._version)}, "items": items}
        return FakeResponse(200, json.dumps(body).encode())

    def _open_watch(self, query: dict[str, str]) -> FakeResponse:
        w = _Watch(query.get("labelSelector", ""), query.get("resourceVersion", ""),
                   query.get("timeoutSeconds", ""))
        self._watches.append(w)
        self._changed.notify_all()
        return w.response

    def _open_watches(self) -> list[_Watch]:
        return [w for w in self._watches if w.open]

    def _stamp(self, obj: dict) -> dict:
        self._version += 1
        obj = json.loads(json.dumps(obj))
        obj["metadata"]["resourceVersion"] = str(self._version)
        return obj

    def _send(self, kind: str, obj: dict) -> None:
        for w in self._open_watches():
            if _matches(w.selector, obj["metadata"]["labels"]):
                w.send(kind, obj)
