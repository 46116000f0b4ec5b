"""The Mooncake Store processes of `pdserve up --kvstore-backend mooncake`: one
`mooncake_master` (object placement and replicas, the transfer engine's HTTP metadata
server, /metrics) and one store node per replica (`mooncake_client`, contributing a
memory segment of the kvstore's capacity). The kvstore indexes what they hold; the
workers move bytes to and from them directly (services/kvstore/transports/mooncake/plane.py).

Ports, from base_port on: the master's RPC, its metadata server, its /metrics, then each
store node's service port and its /metrics.

The workers share the store nodes' host: each attaches to one as its dummy client and
moves bytes by shared memory (services/kvstore/transports/mooncake/local.py); the
kvstore names the nodes to them (--mooncake-store-node). The nodes copy between those
buffers and their segments with memcpy (MC_STORE_MEMCPY=1; Mooncake turns it on by itself
for TCP only, and would loop an RDMA transfer back through the NIC otherwise).
"""
from __future__ import annotations

import importlib.util
import os
import stat
from dataclasses import dataclass

from pdserve.services.kvstore.transports.mooncake.plane import DEFAULT_FAILOVER_S, MASTER_CLIENT_TTL_S

MOONCAKE_BASE_PORT = 50100
# The kvstore's index holds this share of one node's segment: it evicts (and removes from
# Mooncake) before the master's own eviction starts at its 90 % high watermark, so what the
# index names is normally there.
INDEX_SHARE = 0.85
PIP_HINT = ("pip install mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine (CUDA), "
            "and Debian's libibverbs1")


def mooncake_binary(name: str) -> str:
    """The path of a program the mooncake package ships; RuntimeError naming the package when
    it is not installed."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or spec.origin is None:
        raise RuntimeError(f"--kvstore-backend mooncake: the mooncake package is not installed ({PIP_HINT})")
    path = os.path.join(os.path.dirname(spec.origin), name)
    if not os.path.isfile(path):
        raise RuntimeError(f"--kvstore-backend mooncake: {path} is missing from the mooncake package")
    if not os.access(path, os.X_OK):  # wheels may drop the executable bit
        os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def advertised_address_env(host: str) -> dict[str, str]:
    """MC_TCP_BIND_ADDRESS for a Mooncake process serving on `host` (none for a wildcard:
    Mooncake then picks an interface itself). Mooncake 0.3 takes it as the address its
    transfer engine advertises; its listening sockets still bind every interface
    (docs/security.md)."""
    return {} if host in ("", "0.0.0.0", "::") else {"MC_TCP_BIND_ADDRESS": host}


@dataclass(frozen=True)
class MooncakePlan:
    base_port: int = MOONCAKE_BASE_PORT
    replicas: int = 1     # copies of each block; as many store nodes are started
    protocol: str = "tcp"

    def __post_init__(self):
        if not 1 <= self.replicas <= 8:
            raise ValueError(f"--kvstore-replicas: {self.replicas} is not between 1 and 8")
        if not 0 < self.base_port < 65536 - self.num_ports:
            raise ValueError(f"--mooncake-base-port: {self.base_port} leaves no room for its ports")

    @property
    def num_ports(self) -> int:
        return 3 + 2 * self.replicas

    def store_node(self, host: str, i: int) -> str:
        """Store node i's service address, which the workers on its host attach to."""
        return f"{host}:{self.base_port + 3 + 2 * i}"

    @property
    def master_port(self) -> int:
        return self.base_port

    @property
    def metadata_port(self) -> int:
        return self.base_port + 1

    def kvstore_args(self, host: str, segment_bytes: int) -> list[str]:
        return ["--backend", "mooncake", "--mooncake-master", f"{host}:{self.master_port}",
                "--mooncake-metadata", f"http://{host}:{self.metadata_port}/metadata",
                "--mooncake-replicas", str(self.replicas), "--mooncake-protocol", self.protocol,
                "--mooncake-failover-s", str(DEFAULT_FAILOVER_S),
                "--capacity-bytes", str(int(segment_bytes * INDEX_SHARE)),
                *[arg for i in range(self.replicas) for arg in ("--mooncake-store-node", self.store_node(host, i))]]

    # the store nodes' environment: local puts and gets by memcpy (see the module's docstring)
    NODE_ENV = {"MC_STORE_MEMCPY": "1"}

    def node_env(self, host: str) -> dict[str, str]:
        """A store node's environment on `host`: NODE_ENV, and the address its transfer
        engine advertises (without MC_TCP_BIND_ADDRESS it names the host's first
        non-loopback interface, whatever --host says: a peer on loopback would be sent there)."""
        return {**self.NODE_ENV, **advertised_address_env(host)}

    def processes(self, host: str, segment_bytes: int) -> list[tuple[str, list[str], str, int, int]]:
        """(name, argv, address, metrics port, stage) of the master (stage -1) and each store
        node (stage 0): started before the kvstore (stage 1), stopped after it."""
        master = f"{host}:{self.master_port}"
        metadata = f"http://{host}:{self.metadata_port}/metadata"
        master_metrics = self.base_port + 2
        procs = [("mooncake-master",
                  [mooncake_binary("mooncake_master"), f"--rpc_port={self.master_port}", f"--rpc_address={host}",
                   "--enable_http_metadata_server=true", f"--http_metadata_server_host={host}",
                   f"--http_metadata_server_port={self.metadata_port}",
                   f"--metrics_host={host}", f"--metrics_port={master_metrics}",
                   # a store node not heard from for this long is dropped and its segment unmounted:
                   # its objects' other replicas serve from then on
                   f"--client_ttl={MASTER_CLIENT_TTL_S}"],
                  master, master_metrics, -1)]
        for i in range(self.replicas):
            port, metrics_port = self.base_port + 3 + 2 * i, self.base_port + 4 + 2 * i
            procs.append((f"store-{i}",
                          [mooncake_binary("mooncake_client"), f"--global_segment_size={segment_bytes}",
                           f"--master_server_address={master}", f"--metadata_server={metadata}",
                           f"--host={host}", f"--port={port}", f"--protocol={self.protocol}",
                           "--enable_http_server=true", f"--http_port={metrics_port}"],
                          f"{host}:{port}", metrics_port, 0))
        return procs
