"""A worker on the same host as a Mooncake store node moves no byte over TCP: it attaches
to that node as Mooncake's "dummy client" (setup_dummy). Its buffers are shared memory
(memfd) it hands to the node once (over the node's abstract Unix socket,
`@mooncake_client_<port>.sock`); a put or get is then one RPC naming offsets in them, and
the node copies between them and its segment with memcpy (MC_STORE_MEMCPY=1,
cli/mooncake_procs.py). The transfers themselves: services/kvstore/transports/mooncake/client.py.

Which node is "on this host" (local_store_nodes): one whose address this machine can bind;
a loopback address only when the kvstore is on this machine too (it names its own nodes by
its own host, so 127.0.0.1 there is not 127.0.0.1 here). A node that does not accept on its
service port is not attached to (the dummy client would wait seconds to find that out).
"""
from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from collections.abc import Callable

from pdserve.services.common.address import split_host_port
from pdserve.services.kvstore.transports.mooncake.plane import MooncakeSettings, MooncakeUnavailable, replicate_config

logger = logging.getLogger(__name__)

# Mooncake's error code when a dummy client's RPC to its store node fails (the node is gone)
RPC_FAIL = -900
# ... and when the node does not know the memory a transfer names (INVALID_PARAMS): a node
# restarted since the buffers were registered, which lost their registrations. Both mean
# "not through this node now": the transfers go over TCP until the probe has attached a
# fresh dummy client to the node (LocalNode).
INVALID_PARAMS = -600
LOST_CODES = (RPC_FAIL, INVALID_PARAMS)
# What a dummy client asks its store node to map for Mooncake's own staging buffer: the
# block paths never copy through it
LOCAL_NODE_BUFFER_BYTES = 1 << 20
_PROBE_INTERVAL_S = 0.5  # how often a local store node that is gone is looked for
_PROBE_KEY = "pdserve/probe"
_ACCEPT_TIMEOUT_S = 1.0


def _addresses(host: str) -> list[tuple]:
    try:
        return socket.getaddrinfo(host, 0, type=socket.SOCK_DGRAM)
    except OSError:
        return []


def is_local_address(host: str) -> bool:
    """Whether `host` is an address of this machine (binding to it works)."""
    for family, kind, proto, _, address in _addresses(host):
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind(address)
            return True
        except OSError:
            continue
    return False


def is_loopback(host: str) -> bool:
    found = _addresses(host)
    return bool(found) and all(ipaddress.ip_address(address[0].split("%")[0]).is_loopback
                               for *_, address in found)


def local_store_nodes(settings: MooncakeSettings, kvstore_host: str) -> list[str]:
    """The store nodes the settings name on this machine, in their order; `kvstore_host`:
    the host the kvstore that named them was reached at (see the module's docstring)."""
    kvstore_here = is_local_address(kvstore_host)
    nodes = []
    for node in settings.store_nodes:
        host = split_host_port(node, "store node")[0]
        if is_local_address(host) and (kvstore_here or not is_loopback(host)):
            nodes.append(node)
    return nodes


def connect_local(node: str, pool_bytes: int):
    """A Mooncake dummy client attached to the store node whose service is `node`
    ("host:port") on this machine: its buffers must come from its alloc_from_mem_pool
    (shared memory the node maps), each registered whole (register_buffer(base, size)).
    Raises MooncakeUnavailable (the node is not running, or not on this machine: its Unix
    socket is not in this network namespace)."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise MooncakeUnavailable(f"the mooncake package is missing ({e})") from None
    host, port = split_host_port(node, "store node")
    try:
        socket.create_connection((host, int(port)), timeout=_ACCEPT_TIMEOUT_S).close()
    except OSError as e:
        raise MooncakeUnavailable(f"the Mooncake store node {node} does not accept connections ({e})") from None
    store = MooncakeDistributedStore()
    code = store.setup_dummy(pool_bytes, LOCAL_NODE_BUFFER_BYTES, node)
    if code != 0:
        raise MooncakeUnavailable(f"attaching to the Mooncake store node {node} on this host failed "
                                  f"with code {code}")
    return store


class LocalNode:
    """The store node on this host, attached to as Mooncake's dummy client
    (connect_local), and whether it serves: `gone()` (a transfer through it failed as
    LOST_CODES) starts a probe that, once the node's service port accepts, attaches a fresh
    dummy client to it and hands that over (`on_back`): the node serves through it from then.

    Why a fresh client: the old one reconnects by itself only when its monitor noticed the
    node was gone, and re-sends its shared memory only then. A node killed and restarted
    between two of its checks answers the old client's RPCs without knowing its memory, and
    every transfer fails; seen here on the third of three restarts in a row, and in issue 49
    as 70 s of failed writes. A fresh client maps its memory on the node it attaches to."""

    def __init__(self, node: str, client, settings: MooncakeSettings,
                 reconnect: Callable[[], object] | None = None):
        """`node`: its service address, "host:port"; `client`: attached to it; `reconnect`:
        a fresh client attached to it (connect_local), or None: the old one is kept."""
        self.node, self.client = node, client
        self.config = replicate_config(settings)
        self._reconnect = reconnect
        self.on_back: Callable[[object], None] = lambda client: None
        self.num_gone = 0  # times the node was found gone
        self.num_transfers = 0  # batches moved through it (a put or a get): pdserve_worker_mooncake_local_*
        self._serving, self._closed = threading.Event(), threading.Event()
        self._serving.set()
        self._lock = threading.Lock()
        self._probe: threading.Thread | None = None

    @property
    def up(self) -> bool:
        return self._serving.is_set()

    def put(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        return self._counted(self.client.batch_put_from(keys, ptrs, sizes, self.config))

    def get(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        return self._counted(self.client.batch_get_into(keys, ptrs, sizes))

    def _counted(self, codes: list[int]) -> list[int]:
        if not any(code in LOST_CODES for code in codes):
            self.num_transfers += 1
        return codes

    def gone(self) -> None:
        with self._lock:
            if not self._serving.is_set() or self._closed.is_set():
                return
            self._serving.clear()
            self.num_gone += 1
            logger.warning("the Mooncake store node %s on this host is gone; blocks move over TCP until it is back",
                           self.node)
            self._probe = threading.Thread(target=self._wait_for_it, name="mooncake-local-probe", daemon=True)
            self._probe.start()

    def _wait_for_it(self) -> None:
        host, port = split_host_port(self.node, "store node")
        while not self._closed.wait(_PROBE_INTERVAL_S):
            try:  # no RPC to a node that is not listening: the client's would wait seconds
                socket.create_connection((host, int(port)), timeout=0.5).close()
                client = self._reconnect() if self._reconnect is not None else self.client
                answer = client.batch_is_exist([_PROBE_KEY])
            except Exception:
                continue
            if not answer or answer[0] < 0:  # the client not reconnected yet
                continue
            self.on_back(client)
            self.client = client
            logger.info("the Mooncake store node %s on this host serves again: blocks move through it",
                        self.node)
            self._serving.set()
            return

    def close(self) -> None:
        self._closed.set()
        if self._probe is not None:
            self._probe.join(timeout=5)
        self.client.close()
