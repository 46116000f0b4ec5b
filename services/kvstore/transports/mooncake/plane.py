"""The Mooncake Store data plane of the kvstore: where block bytes live when the kvstore
runs with `--backend mooncake`.

    prefill worker ──bytes (Mooncake transfer engine, TCP or RDMA)──▶ store nodes' segments
         └──────── PutBlocks(headers, bytes_in_data_plane) ─────────▶ kvstore: index, leases
    decode worker ◀─bytes (batch_get_into its import buffer)──────── store nodes' segments
         └──────── GetBlocks(headers_only) ─────────────────────────▶ kvstore: which, headers

The pdserve kvstore keeps what it is for (leases, the block index and its KV events, the
internal token on control calls, metrics); the bytes go from a worker's buffer into a
store node's memory (a `mooncake_client` process contributing a segment) without passing
through Python. `mooncake_master` places objects and keeps their replicas.

A block's object key names its store key and its checksum, so the writer and every reader
agree on it from the header alone, and a tail written again with other bytes is a new
object (Mooncake's put keeps the first bytes under a key).

A worker on a store node's host may move its bytes through that node by shared memory
instead (services/kvstore/transports/mooncake/local.py).
"""
from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass

from pdserve.services.common.address import split_host_port

PROTOCOLS = ("tcp", "rdma")
MASTER_CLIENT_TTL_S = 3  # `pdserve up`'s and the chart's mooncake_master --client_ttl
# Reads retried this long after a transfer failed: the master drops a silent node within
# about two of its TTLs (it checks on a period of its own), and a margin.
DEFAULT_FAILOVER_S = 2 * MASTER_CLIENT_TTL_S + 2.0
TRANSFER_FAIL = -800     # Mooncake's error code for a transfer to or from a node that is gone
# A kvstore with a data plane says so in the initial metadata of every Stats answer, as a
# JSON object of MooncakeSettings: the workers' clients connect to the plane from that.
MOONCAKE_METADATA = "pdserve-kvstore-mooncake"
_KEY_PREFIX = "pdserve/"
# What a worker's client sets aside for Mooncake's own staging buffer: the block paths
# register the engine's buffers and never copy through it.
LOCAL_BUFFER_BYTES = 16 << 20
# What a worker's client keeps of the buffers its reads landed in, registered and mapped,
# for the next reads (transports/mooncake/buffers.py, ReadBuffers): a read into fresh memory pays a page
# fault per 4 KiB, which cost more than the transfer here.
READ_BUFFER_BYTES = 512 << 20
# The nice value of the threads that wait for a worker's transfers: Mooncake's client polls
# for completion without pause, and at this priority the polling leaves the cores to the
# threads that move the bytes (transports/mooncake/client.py).
TRANSFER_WAIT_NICE = 19


class MooncakeUnavailable(RuntimeError):
    """The mooncake package is missing or the master cannot be reached."""


@dataclass(frozen=True)
class MooncakeSettings:
    master: str              # mooncake_master's RPC address, "host:port"
    metadata_server: str     # "http://host:port/metadata" (the master's HTTP metadata server)
    replicas: int = 1        # copies of each block, on different store nodes
    protocol: str = "tcp"    # "rdma" where the cluster has it (untested here: no RDMA device)
    rdma_devices: str = ""   # e.g. "mlx5_0,mlx5_1"; only with protocol "rdma"
    # How long a transfer that failed is tried again while other replicas exist: Mooncake
    # reads the replica it picked, dead node or not, until the master drops the node (its
    # --client_ttl, MASTER_CLIENT_TTL_S); from then on the other replicas serve.
    failover_s: float = 0.0
    # The store nodes a worker on their host may attach to, their real-client service
    # addresses ("host:port", mooncake_client --port): `pdserve up` names its own; in a
    # cluster each worker names the node on its host itself (--mooncake-local-node)
    store_nodes: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "store_nodes", tuple(self.store_nodes))  # from JSON: a list
        for node in self.store_nodes:
            split_host_port(node, "mooncake_store_node")
        split_host_port(self.master, "mooncake_master")
        if not self.metadata_server.startswith(("http://", "etcd://", "redis://")) and self.metadata_server != "P2PHANDSHAKE":
            raise ValueError(f"mooncake_metadata: {self.metadata_server!r} is not an http://, etcd:// or redis:// "
                             "address (or P2PHANDSHAKE)")
        if not 1 <= self.replicas <= 8:
            raise ValueError(f"mooncake_replicas: {self.replicas} is not between 1 and 8")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"mooncake_protocol: {self.protocol!r} is not one of {PROTOCOLS}")
        if self.rdma_devices and self.protocol != "rdma":
            raise ValueError("mooncake_rdma_devices: only with mooncake_protocol 'rdma'")
        if not 0 <= self.failover_s <= 600:
            raise ValueError(f"mooncake_failover_s: {self.failover_s} is not between 0 and 600 seconds")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> MooncakeSettings:
        return cls(**json.loads(text))


def object_key(store_key: bytes, checksum: int) -> str:
    return f"{_KEY_PREFIX}{store_key.hex()}/{checksum:08x}"


def local_hostname(master: str) -> str:
    """The address this host reaches the master from: what the transfer engine advertises
    to its peers (a pod's IP in a cluster, 127.0.0.1 on one machine)."""
    host, port = split_host_port(master, "mooncake_master")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # UDP: no packet is sent
        probe.connect((host, int(port)))
        return probe.getsockname()[0]


def connect(settings: MooncakeSettings, segment_bytes: int = 0):
    """A Mooncake Store client; `segment_bytes` > 0 also contributes that much memory of
    this process to the store (a store node). Raises MooncakeUnavailable."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise MooncakeUnavailable("the kvstore backend 'mooncake' needs the mooncake package: pip install "
                                  "mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine (CUDA), "
                                  f"and Debian's libibverbs1 ({e})") from None
    store = MooncakeDistributedStore()
    hostname = local_hostname(settings.master)
    # what its transfer engine advertises: without it, the host's first non-loopback
    # interface, which a peer reaching the master over loopback may not reach
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", hostname)
    code = store.setup(hostname, settings.metadata_server, segment_bytes, LOCAL_BUFFER_BYTES,
                       settings.protocol, settings.rdma_devices, settings.master)
    if code != 0:
        raise MooncakeUnavailable(f"Mooncake Store setup against master {settings.master} and metadata "
                                  f"{settings.metadata_server} failed with code {code}")
    return store


def replicate_config(settings: MooncakeSettings):
    from mooncake.store import ReplicateConfig
    config = ReplicateConfig()
    config.replica_num = settings.replicas
    return config
