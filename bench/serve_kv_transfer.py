"""KV transfer throughput (issue 7 experiment 5, issue 13): real KV blocks of SmolLM2's
shape put to and read back from the kvstore over each transport and backend, against the
raw loopback TCP throughput of the same bytes measured in the same run.

The paths the workers take: put_blocks from one contiguous payload tensor (as the engine
exports it), get_blocks into a KVPayload tensor (as the decode imports it). The old
one-block-per-message Put/Get is measured once more for comparison. With the Mooncake
backend (a real mooncake_master and store node on loopback, issue 32) the bytes go from
the payload straight to the store node; its line breaks the time down (the kvstore's
index calls, Mooncake's transfer, the rest).

    .venv/bin/python -m bench.serve_kv_transfer [--num-blocks 64] [--repeats 3]
        [--paths memory-tcp,memory-grpc]   (default: every path)

The kvstores run in this process, with the allocator settings `pdserve kvstore` gives its
own process (services/kvstore/heap.py: freed memory kept for the next blocks), for every
path alike.

Prints one JSON line per path with MB/s and `ratio_vs_raw_socket`, and for the workers'
path `kv_wire_ms` (per put+get: the CRC-32 seal and check, and joining an answer of several
batches into one tensor) with `ratio_without_kv_wire` (the same put+get less that: what
the transport and store cost). The raw loopback
measurement is taken again after each path, and each path's ratio is against the mean
of the two around it, so a machine that gets busier or quieter during the run moves
both sides of a ratio alike.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

from cli.bench.mooncake_cluster import MooncakeCluster
from engine.dtypes import dtype_name
from engine.kv_transfer import KVLayout, KVPayload
from services.worker.kv_wire import block_from_proto, block_to_proto, payload_from_batches, payload_to_put
from services.kvstore import heap
from services.kvstore.client import KVStoreClient
from services.kvstore.server import KVStoreConfig, serve

# SmolLM2-135M: 30 layers, K and V, block of 16 tokens, 3 KV heads of 64, float32
BLOCK_SHAPE = (30, 2, 16, 3, 64)


def make_payload(num_blocks: int, seed: int) -> KVPayload:
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randn((num_blocks, *BLOCK_SHAPE), generator=gen)
    return KVPayload(num_blocks * 16, blocks, [os.urandom(32) for _ in range(num_blocks)])


def raw_socket_mbps(payload: bytes, repeats: int) -> float:
    """Send the bytes over a loopback TCP connection and read them back whole, as a put+get."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def echo():
        conn, _ = server.accept()
        with conn:
            for _ in range(repeats):
                data = bytearray()
                while len(data) < len(payload):
                    data += conn.recv(1 << 20)
                conn.sendall(data)
    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    with socket.create_connection(("127.0.0.1", port)) as client:
        start = time.perf_counter()
        for _ in range(repeats):
            client.sendall(payload)
            got = 0
            while got < len(payload):
                got += len(client.recv(1 << 20))
        elapsed = time.perf_counter() - start
    thread.join()
    server.close()
    return 2 * len(payload) * repeats / elapsed / 1e6


def store_mbps(client: KVStoreClient, payload: KVPayload, repeats: int,
               spent: dict[str, float] | None = None) -> tuple[float, float]:
    """put_blocks then get_blocks of the payload, as the workers do (export layout in, a
    KVPayload tensor out, each block sealed and checked: kv_wire.py); MB/s of each
    direction (bytes of block data). `spent`: seconds added under "kv_wire" (in kv_wire:
    sealing the headers with CRC-32, checking the blocks read, and joining an answer of
    several batches into one tensor) and "total"."""
    num_bytes = payload.blocks.numel() * payload.blocks.element_size()
    put_s = get_s = kv_wire_s = 0.0
    layout = KVLayout.of("bench", dtype_name(payload.blocks.dtype), tuple(payload.blocks.shape[1:]))
    for _ in range(repeats):
        t0 = time.perf_counter()
        headers, data = payload_to_put(payload, layout, tail_key="")
        t1 = time.perf_counter()
        client.put_blocks(headers, data)
        t2 = time.perf_counter()
        batches = client.get_blocks(payload.block_hashes)
        t3 = time.perf_counter()
        got = payload_from_batches(batches, payload.block_hashes, layout).payload
        t4 = time.perf_counter()
        put_s, get_s, kv_wire_s = put_s + t2 - t0, get_s + t4 - t2, kv_wire_s + (t1 - t0) + (t4 - t3)
        assert got is not None and got.num_blocks == payload.num_blocks
    assert torch.equal(got.blocks, payload.blocks)
    if spent is not None:
        spent["kv_wire"] = spent.get("kv_wire", 0.0) + kv_wire_s
        spent["total"] = spent.get("total", 0.0) + put_s + get_s
    return num_bytes * repeats / put_s / 1e6, num_bytes * repeats / get_s / 1e6


def store_mbps_per_block(client: KVStoreClient, payload: KVPayload, repeats: int) -> tuple[float, float]:
    """The one-block-per-message Put and Get (before issue 13), for comparison: as the
    workers did, the messages are built from the payload and the tensor from the answer."""
    num_bytes = payload.blocks.numel() * payload.blocks.element_size()
    put_s = get_s = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        client.put([block_to_proto(b, 16, block_hash=h) for b, h in zip(payload.blocks, payload.block_hashes)])
        put_s += time.perf_counter() - t
        t = time.perf_counter()
        got = torch.stack([block_from_proto(b) for b in client.get(payload.block_hashes)])  # as decodes did
        get_s += time.perf_counter() - t
    assert torch.equal(got, payload.blocks)
    return num_bytes * repeats / put_s / 1e6, num_bytes * repeats / get_s / 1e6


def mooncake_breakdown(client: KVStoreClient, payload: KVPayload, repeats: int) -> dict[str, float]:
    """Where a Mooncake put+get's time goes, in ms per put+get: the kvstore's index calls
    (gRPC), Mooncake's own transfers (batch_put_from/batch_get_into, their buffer
    registration included), and the rest (headers, sealing, the payload's views)."""
    transport = client._block_transport()
    spent = {"index_ms": 0.0, "transfer_ms": 0.0}

    def timed(key, method):
        def call(*args):
            t = time.perf_counter()
            try:
                return method(*args)
            finally:
                spent[key] += (time.perf_counter() - t) * 1e3
        return call
    control, plane = transport._control, transport._plane
    originals = (control.put_blocks, control.get_blocks, transport._put_bytes, transport._get_bytes)
    control.put_blocks, control.get_blocks = timed("index_ms", originals[0]), timed("index_ms", originals[1])
    transport._put_bytes, transport._get_bytes = timed("transfer_ms", originals[2]), timed("transfer_ms", originals[3])
    try:
        t = time.perf_counter()
        store_mbps(client, payload, repeats)
        total_ms = (time.perf_counter() - t) * 1e3
    finally:
        control.put_blocks, control.get_blocks, transport._put_bytes, transport._get_bytes = originals
    spent["other_ms"] = total_ms - spent["index_ms"] - spent["transfer_ms"]
    return {k: round(v / repeats, 1) for k, v in spent.items()}


def start_redis() -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (make setup installs it)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--maxmemory-policy", "noeviction"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("redis-server did not start")


# name: (backend, transport, measure); "redis" stands for the URL of a redis-server started here
PATHS = {"mooncake": ("mooncake", "mooncake", store_mbps), "memory-grpc": ("memory", "grpc", store_mbps),
         "memory-tcp": ("memory", "tcp", store_mbps), "memory-ucx": ("memory", "ucx", store_mbps),
         "redis-grpc": ("redis", "grpc", store_mbps), "memory-grpc-per-block": ("memory", "grpc", store_mbps_per_block)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    args = parser.parse_args()
    names = args.paths.split(",")
    if unknown := [n for n in names if n not in PATHS]:
        parser.error(f"--paths: {unknown} not among {list(PATHS)}")
    payload = make_payload(args.num_blocks, seed=0)
    num_bytes = payload.blocks.numel() * payload.blocks.element_size()
    heap.keep_freed_memory(4 * num_bytes)  # as `pdserve kvstore` does for its capacity
    raw_bytes = payload.blocks.numpy().tobytes()
    raw = raw_socket_mbps(raw_bytes, args.repeats)
    print(json.dumps({"path": "raw loopback TCP (send + echo)", "mb_s": round(raw, 1), "bytes": num_bytes}))
    redis_proc, redis_url = start_redis() if "redis-grpc" in names else (None, "")
    mooncake = MooncakeCluster(Path(tempfile.mkdtemp(prefix="bench-mooncake-")),
                               segment_bytes=8 * num_bytes).start_all() if "mooncake" in names else None
    try:
        for name in names:
            backend, transport, measure = PATHS[name]
            backend = redis_url if backend == "redis" else backend
            store = serve(KVStoreConfig(capacity_bytes=4 * num_bytes, metrics_port=None, backend=backend,
                                        ucx_port=0 if transport == "ucx" else None,
                                        tcp_port=0 if transport == "tcp" else None,
                                        mooncake=mooncake.settings if backend == "mooncake" else None))
            client = KVStoreClient(store.address, transport=transport)
            spent: dict[str, float] = {}
            try:
                measure(client, payload, 1)  # untimed: connect, and let gRPC's flow control windows grow
                put, get = measure(client, payload, args.repeats, spent) if measure is store_mbps else \
                    measure(client, payload, args.repeats)
                breakdown = mooncake_breakdown(client, payload, args.repeats) if backend == "mooncake" else {}
            finally:
                client.close()
                store.stop()
            both = 2 / (1 / put + 1 / get)
            raw_after = raw_socket_mbps(raw_bytes, args.repeats)
            raw_mean = (raw + raw_after) / 2
            if spent:  # the same put+get less kv_wire's seal, check and join: what the transport itself costs
                wire = {"kv_wire_ms": round(spent["kv_wire"] / args.repeats * 1e3, 1),
                        "ratio_without_kv_wire": round(2 * num_bytes * args.repeats / 1e6 / (
                            spent["total"] - spent["kv_wire"]) / raw_mean, 2)}
            else:
                wire = {}
            label = f"kvstore {backend if backend in ('memory', 'mooncake') else 'redis'} over {transport}"
            print(json.dumps({"path": label + (" (one block per message)" if measure is store_mbps_per_block else ""),
                              "put_mb_s": round(put, 1), "get_mb_s": round(get, 1), "raw_mb_s": round(raw_mean, 1),
                              "ratio_vs_raw_socket": round(both / raw_mean, 2), **wire, **breakdown}))
            raw = raw_after
    finally:
        if mooncake is not None:
            mooncake.stop()
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait()


if __name__ == "__main__":
    main()
