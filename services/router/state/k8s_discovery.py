"""Discovery in a cluster: each pool's workers are the ready endpoints of the
EndpointSlices that match a label selector (the chart uses the slices of each pool's
headless Service: `kubernetes.io/service-name=<release>-prefill`).

One watcher per pool keeps its answer current, the informer pattern:

    list ─▶ replace every slice ─▶ watch from the list's resourceVersion
     ▲                               │ ADDED, MODIFIED: store the slice's ready addresses
     │                               │ DELETED: drop the slice
     └─ the watch ended: after timeout_seconds = resync_s (a full re-list, the resync),
        on 410 Gone (the API server compacted that history: re-list at once), or on an
        error (API server unreachable: keep the last answer, re-list after a backoff)

An endpoint is used when `conditions.ready` is not false (unset means ready, as the API
says) and its slice has the port named `port_name`. A terminating pod is not ready, so a
worker that starts draining takes no new work at once; the requests this router has open
on it keep their channel and finish (workers.py), and the poller's health checks catch
the rest. The registry asks `addresses()` on every poll, so changes need no restart.
"""
from __future__ import annotations

import argparse
import logging
import threading
from collections.abc import Callable

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from pdserve.services.router.state.discovery import DECODE, PREFILL, Discovery

logger = logging.getLogger(__name__)

HTTP_GONE = 410
_SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def ready_addresses(endpoint_slice: client.V1EndpointSlice, port_name: str) -> tuple[str, ...]:
    """host:port of each ready endpoint of one slice; () when it lacks the named port."""
    port = next((p.port for p in endpoint_slice.ports or () if p.name == port_name and p.port), None)
    if port is None:
        return ()
    found = []
    for endpoint in endpoint_slice.endpoints or ():
        conditions = endpoint.conditions
        if (conditions is not None and conditions.ready is False) or not endpoint.addresses:
            continue
        host = endpoint.addresses[0]  # the API: all of an endpoint's addresses are fungible
        found.append(f"[{host}]:{port}" if endpoint_slice.address_type == "IPv6" else f"{host}:{port}")
    return tuple(found)


class EndpointSliceWatcher:
    """The ready addresses of one pool: the slices matching `selector` in `namespace`."""

    def __init__(self, api: client.DiscoveryV1Api, namespace: str, selector: str, port_name: str = "grpc",
                 resync_s: float = 300.0, backoff_s: float = 1.0, max_backoff_s: float = 30.0):
        self._api, self._namespace, self._selector, self._port_name = api, namespace, selector, port_name
        self._resync_s, self._backoff_s, self._max_backoff_s = resync_s, backoff_s, max_backoff_s
        self._slices: dict[str, tuple[str, ...]] = {}
        self._lock = threading.Lock()
        self._watch = watch.Watch()
        self._stop = threading.Event()
        self.synced = threading.Event()  # set by the first successful list

    def addresses(self) -> tuple[str, ...]:
        with self._lock:
            return self._addresses_locked()

    def run(self) -> None:
        """List and watch until stop(); never raises (the last answer stays in use)."""
        failures = 0
        while not self._stop.is_set():
            try:
                resource_version = self._list()
                failures = 0
                self._watch_from(resource_version)  # returns at the resync or on 410 Gone
            except ApiException as e:
                failures += 1
                logger.warning("endpointslices %r: %s %s", self._selector, e.status, e.reason)
            except Exception as e:  # noqa: BLE001 - the API server or the network away: retry, never die
                failures += 1
                logger.warning("endpointslices %r: %s: %s", self._selector, type(e).__name__, e)
            if failures:
                self._stop.wait(min(self._max_backoff_s, self._backoff_s * 2 ** (failures - 1)))

    def stop(self) -> None:
        self._stop.set()
        self._watch.stop()

    def _list(self) -> str:
        """Replace every slice with what the API server has now; returns its resourceVersion."""
        listed = self._api.list_namespaced_endpoint_slice(self._namespace, label_selector=self._selector,
                                                          _request_timeout=30)
        slices = {s.metadata.name: ready_addresses(s, self._port_name) for s in listed.items}
        self._replace(slices)
        self.synced.set()
        return listed.metadata.resource_version

    def _watch_from(self, resource_version: str) -> None:
        if self._stop.is_set():  # stopped while listing: a new stream would not see it
            return
        stream = self._watch.stream(
            self._api.list_namespaced_endpoint_slice, self._namespace, label_selector=self._selector,
            resource_version=resource_version, timeout_seconds=max(1, int(self._resync_s)),
            allow_watch_bookmarks=True, _request_timeout=(30, self._resync_s + 30))
        try:
            for event in stream:
                if self._stop.is_set():
                    return
                self._apply(event["type"], event["object"])
        except ApiException as e:
            if e.status != HTTP_GONE:
                raise
            # the API server no longer has our resourceVersion's history: list again now
            logger.info("endpointslices %r: watch expired (410 Gone); re-listing", self._selector)

    def _apply(self, kind: str, endpoint_slice) -> None:
        if kind not in ("ADDED", "MODIFIED", "DELETED"):  # BOOKMARK: only a newer resourceVersion
            return
        name = endpoint_slice.metadata.name
        with self._lock:
            before = self._addresses_locked()
            if kind == "DELETED":
                self._slices.pop(name, None)
            else:
                self._slices[name] = ready_addresses(endpoint_slice, self._port_name)
            after = self._addresses_locked()
        if before != after:
            logger.info("endpointslices %r: %s %s: %d ready", self._selector, kind.lower(), name, len(after))

    def _replace(self, slices: dict[str, tuple[str, ...]]) -> None:
        with self._lock:
            self._slices = slices

    def _addresses_locked(self) -> tuple[str, ...]:
        """Sorted, without repeats: a pod may briefly be in two slices while they are rebalanced."""
        return tuple(sorted({a for addresses in self._slices.values() for a in addresses}))


class KubernetesDiscovery(Discovery):
    """Both pools from EndpointSlices, each kept current by its own watcher thread."""

    def __init__(self, api: client.DiscoveryV1Api, namespace: str, prefill_selector: str, decode_selector: str,
                 port_name: str = "grpc", resync_s: float = 300.0, backoff_s: float = 1.0):
        self._watchers = {pool: EndpointSliceWatcher(api, namespace, selector, port_name, resync_s, backoff_s)
                          for pool, selector in ((PREFILL, prefill_selector), (DECODE, decode_selector))}
        self._threads = [threading.Thread(target=w.run, name=f"k8s-discovery-{pool}", daemon=True)
                         for pool, w in self._watchers.items()]

    def start(self, wait_s: float = 10.0) -> bool:
        """Start watching; waits up to `wait_s` for the first list of each pool, so the router
        knows its workers before serving. False when a pool is not listed yet (the router
        starts anyway: its pools fill in when the API server answers)."""
        for thread in self._threads:
            thread.start()
        return all(w.synced.wait(wait_s) for w in self._watchers.values())

    def addresses(self, pool: str) -> tuple[str, ...]:
        return self._watchers[pool].addresses()

    def stop(self, join_s: float = 1.0) -> None:
        for w in self._watchers.values():
            w.stop()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(join_s)


def in_cluster_api() -> client.DiscoveryV1Api:
    """The API of the cluster this pod runs in (its service account), or of the current
    kubeconfig context outside a cluster."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except (config.ConfigException, OSError) as e:
            raise ValueError(f"--discovery kubernetes: not in a pod and no usable kubeconfig ({e})") from None
    return client.DiscoveryV1Api(client.ApiClient())


def current_namespace(read: Callable[[str], str] | None = None) -> str:
    """The pod's own namespace, from its service account; "default" outside a cluster."""
    try:
        return (read or _read_text)(_SERVICE_ACCOUNT_NAMESPACE).strip() or "default"
    except OSError:
        return "default"


def _read_text(path: str) -> str:
    with open(path) as f:
        return f.read()


def kubernetes_discovery(namespace: str | None, prefill_selector: str, decode_selector: str,
                         port_name: str = "grpc", resync_s: float = 300.0) -> KubernetesDiscovery:
    """What `pdserve router --discovery kubernetes` builds (not started yet)."""
    for flag, selector in (("--prefill-selector", prefill_selector), ("--decode-selector", decode_selector)):
        if not selector:
            raise ValueError(f"{flag}: a label selector is needed with --discovery kubernetes")
    if resync_s <= 0:
        raise ValueError(f"--discovery-resync-s: must be > 0, got {resync_s}")
    return KubernetesDiscovery(in_cluster_api(), namespace or current_namespace(), prefill_selector,
                               decode_selector, port_name, resync_s)


def add_discovery_arguments(parser: argparse.ArgumentParser) -> None:
    """The router's discovery flags (`pdserve router`)."""
    parser.add_argument("--discovery", choices=["static", "kubernetes", "file"], default="static",
                        help="where the workers come from: the --prefill/--decode lists (static, the default), "
                             "the ready endpoints of Kubernetes EndpointSlices (kubernetes), or a JSON file "
                             "another process rewrites (file: --discovery-file, `pdserve up --autoscale`)")
    parser.add_argument("--discovery-file", default="", metavar="PATH",
                        help='with --discovery file: {"prefill": ["host:port", ..], "decode": [..]}, '
                             "read again whenever it changes (services/router/state/file_discovery.py)")
    parser.add_argument("--namespace", default=None,
                        help="with --discovery kubernetes: the workers' namespace (default: the router pod's own)")
    parser.add_argument("--prefill-selector", default="", metavar="LABELS",
                        help="with --discovery kubernetes: label selector of the prefill pool's EndpointSlices, "
                             "e.g. kubernetes.io/service-name=pdserve-prefill")
    parser.add_argument("--decode-selector", default="", metavar="LABELS",
                        help="with --discovery kubernetes: label selector of the decode pool's EndpointSlices")
    parser.add_argument("--discovery-port-name", default="grpc",
                        help="with --discovery kubernetes: the EndpointSlice port to use (the Service's port name)")
    parser.add_argument("--discovery-resync-s", type=float, default=300.0,
                        help="with --discovery kubernetes: seconds between full re-lists of the EndpointSlices")


def discovery_from_args(args: argparse.Namespace) -> Discovery | None:
    """The discovery the flags ask for (not started), or None for the static lists."""
    if args.discovery == "file":
        if not args.discovery_file:
            raise ValueError("--discovery-file: a path is needed with --discovery file")
        from pdserve.services.router.state.file_discovery import FileDiscovery
        return FileDiscovery(args.discovery_file)
    if args.discovery != "kubernetes":
        return None
    return kubernetes_discovery(args.namespace, args.prefill_selector, args.decode_selector,
                                args.discovery_port_name, args.discovery_resync_s)
