"""`pdserve kvstore`: run the KV cache service until SIGINT or SIGTERM.

    pdserve kvstore --port 50060 --capacity-bytes 8GiB --metrics-port 9060
    pdserve kvstore --backend redis://127.0.0.1:6379/0 --ucx-port 50061
    pdserve kvstore --tcp-port 50062
    pdserve kvstore --capacity-bytes 8GiB --disk-dir /var/lib/pdserve/kv --disk-capacity-bytes 64GiB
"""
from __future__ import annotations

import argparse
import re
import sys

from pdserve.services.common.defaults import KVSTORE_PORT
from pdserve.services.common.numbers import number_arg, port_arg
from pdserve.services.common.process import configure_logging, wait_for_shutdown
from pdserve.services.common.security import add_internal_token_argument, add_server_tls_arguments, internal_server_security
from pdserve.services.common.sizes import parse_bytes
from pdserve.services.kvstore import heap
from pdserve.services.kvstore.transports.mooncake import plane as mooncake_plane
from pdserve.services.kvstore.errors import KVStoreError
from pdserve.services.kvstore.server import KVStoreConfig, check_backend, serve
from pdserve.services.kvstore.stores.disk_folder import DiskFolderError

_port = port_arg(note="0 picks a free one")
_positive_ms = number_arg(int, "a number of milliseconds", low=0, low_open=True)


def _backend(text: str) -> str:
    try:
        check_backend(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("backend: ")) from None
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=KVSTORE_PORT,
                        help=f"gRPC port (default: {KVSTORE_PORT}; 0: a free one)")
    parser.add_argument("--metrics-port", type=_port, default=None,
                        help="serve Prometheus /metrics on this port (default: off; 0: a free one)")
    parser.add_argument("--capacity-bytes", type=parse_bytes, default=parse_bytes("1GiB"),
                        help="block bytes to hold before evicting, e.g. 512MiB, 8GiB (default: 1GiB)")
    parser.add_argument("--backend", type=_backend, default="memory",
                        help="'memory' (default), a Redis URL (redis://host:port/db), or 'mooncake': the bytes in "
                             "Mooncake Store (--mooncake-*), this service their index and leases")
    parser.add_argument("--disk-dir", metavar="PATH", default=None,
                        help="also keep full blocks as files in this folder (a disk tier under the memory "
                             "backend, with --disk-capacity-bytes): a restart on the same folder finds them again")
    parser.add_argument("--disk-capacity-bytes", type=parse_bytes, default=None, metavar="SIZE",
                        help="block bytes the disk tier holds before evicting its least recent, e.g. 64GiB")
    parser.add_argument("--lease-ttl-ms", type=_positive_ms, default=30_000,
                        help="TTL of a lease created with ttl_ms = 0, which is what prefill workers ask for: "
                             "how long a prefill's KV stays pinned for its decode (default: 30000)")
    parser.add_argument("--ucx-port", type=_port, default=None,
                        help="also serve Put/Get over UCX on this port (default: off; 0: a free one)")
    parser.add_argument("--tcp-port", type=_port, default=None,
                        help="also serve PutBlocks/GetBlocks as raw TCP frames on this port, on --host, with the "
                             "internal token and the gRPC port's TLS (default: off; 0: a free one)")
    mooncake = parser.add_argument_group("Mooncake Store data plane (--backend mooncake)")
    mooncake.add_argument("--mooncake-master", metavar="HOST:PORT", default=None,
                          help="mooncake_master's RPC address")
    mooncake.add_argument("--mooncake-metadata", metavar="URL", default=None,
                          help="the transfer engine's metadata server, e.g. http://HOST:PORT/metadata (the "
                               "master's, started with --enable_http_metadata_server); default: on the master's "
                               "host, port 8080")
    mooncake.add_argument("--mooncake-replicas", type=int, default=1,
                          help="copies of each block, each on another store node (default: 1)")
    mooncake.add_argument("--mooncake-protocol", choices=mooncake_plane.PROTOCOLS, default="tcp",
                          help="the transfer engine's transport (default: tcp; rdma needs RDMA devices)")
    mooncake.add_argument("--mooncake-rdma-devices", default="", help="RDMA devices, e.g. mlx5_0,mlx5_1")
    mooncake.add_argument("--mooncake-failover-s", type=float, default=None,
                          help="with replicas > 1: how long the workers retry a transfer that hit a dead store "
                               "node, until the master drops it (its --client_ttl) and other replicas serve "
                               f"(default: {mooncake_plane.DEFAULT_FAILOVER_S}, for --client_ttl="
                               f"{mooncake_plane.MASTER_CLIENT_TTL_S})")
    mooncake.add_argument("--mooncake-store-node", action="append", default=[], metavar="HOST:PORT",
                          help="a store node the workers on its host attach to by shared memory (repeatable): "
                               "its real-client service address (mooncake_client --port)")
    add_internal_token_argument(parser)
    add_server_tls_arguments(parser, "the gRPC and TCP ports (UCX has no TLS: docs/security.md)")


def mooncake_settings(args: argparse.Namespace) -> mooncake_plane.MooncakeSettings | None:
    """The data plane the flags name; None without --backend mooncake. ValueError naming
    the flag when they disagree."""
    if args.backend != "mooncake":
        given = [flag for flag, value in (("--mooncake-master", args.mooncake_master),
                                          ("--mooncake-metadata", args.mooncake_metadata),
                                          ("--mooncake-replicas", args.mooncake_replicas != 1),
                                          ("--mooncake-store-node", args.mooncake_store_node)) if value]
        if given:
            raise ValueError(f"{given[0]}: only with --backend mooncake")
        return None
    if not args.mooncake_master:
        raise ValueError("--mooncake-master: --backend mooncake needs mooncake_master's HOST:PORT")
    metadata = args.mooncake_metadata or f"http://{args.mooncake_master.rpartition(':')[0]}:8080/metadata"
    try:
        failover_s = args.mooncake_failover_s
        if failover_s is None:
            failover_s = mooncake_plane.DEFAULT_FAILOVER_S if args.mooncake_replicas > 1 else 0.0
        return mooncake_plane.MooncakeSettings(args.mooncake_master, metadata, args.mooncake_replicas,
                                               args.mooncake_protocol, args.mooncake_rdma_devices, failover_s,
                                               tuple(args.mooncake_store_node))
    except ValueError as e:
        field, _, rest = str(e).partition(":")  # the settings' field, as its flag
        raise ValueError(f"--{field.replace('_', '-')}:{rest}") from None


def check_disk_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag when the disk tier's flags do not go together."""
    if (args.disk_dir is None) != (args.disk_capacity_bytes is None):
        raise ValueError("--disk-dir: goes with --disk-capacity-bytes (both or neither)")
    if args.disk_dir is not None and args.backend != "memory":
        raise ValueError("--disk-dir: a disk tier is for --backend memory only (Redis and Mooncake keep the "
                         "blocks themselves)")


def config_from_args(args: argparse.Namespace) -> KVStoreConfig:
    check_disk_args(args)
    return KVStoreConfig(host=args.host, port=args.port, metrics_port=args.metrics_port,
                         capacity_bytes=args.capacity_bytes, backend=args.backend,
                         default_lease_ttl_ms=args.lease_ttl_ms,
                         max_lease_ttl_ms=max(args.lease_ttl_ms, KVStoreConfig.max_lease_ttl_ms),
                         ucx_port=args.ucx_port, tcp_port=args.tcp_port, security=internal_server_security(args),
                         mooncake=mooncake_settings(args), disk_dir=args.disk_dir,
                         disk_capacity_bytes=args.disk_capacity_bytes)


def run(args: argparse.Namespace) -> int:
    """Serves until SIGINT/SIGTERM (call from the main thread), then stops cleanly."""
    configure_logging("kvstore")
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"pdserve kvstore: error: {e}", file=sys.stderr)
        return 2
    heap.keep_freed_memory(config.capacity_bytes)  # a put's buffers reuse freed memory, no fresh pages
    try:
        running = serve(config)
    except DiskFolderError as e:  # the folder is no fence: the flag's value is what to change
        print(f"pdserve kvstore: error: --disk-dir {e}", file=sys.stderr)
        return 2
    except (KVStoreError, OSError, RuntimeError) as e:  # Redis unreachable, port taken (grpc raises
        # RuntimeError for that): say so, without a traceback
        print(f"pdserve kvstore: error: cannot start: {e}", file=sys.stderr)
        return 1
    backend = re.sub(r"//[^@/]*@", "//***@", args.backend)  # no Redis password in logs
    parts = [f"kvstore serving on {running.address}", f"backend {backend}", f"capacity {args.capacity_bytes}"]
    parts += [f"ucx {running.ucx_address}"] if running.ucx_address else []
    parts += [f"tcp {running.tcp_address}"] if running.tcp_address else []
    if args.disk_dir is not None:  # what a restart found there
        disk = running.store.stats().disk
        parts += [f"disk {args.disk_dir} ({disk.num_blocks} blocks, {disk.used_bytes} bytes)"]
    parts += [f"metrics :{running.metrics_port}"] if running.metrics_port is not None else []
    print(", ".join(parts), flush=True)
    try:
        wait_for_shutdown()
    finally:
        running.stop()
    print("kvstore stopped", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve kvstore", description="The KV cache service")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
