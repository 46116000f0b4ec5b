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

Prints one JSON line per path with MB/s and `ratio_vs_raw_socket`.
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


def store_mbps(client: KVStoreClient, payload: KVPayload, repeats: int) -> tuple[float, float]:
    """put_blocks then get_blocks of the payload, as the workers do (export layout in, a
    KVPayload tensor out); MB/s of each direction (bytes of block data)."""
    num_bytes = payload.blocks.numel() * payload.blocks.element_size()
    put_s = get_s = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        layout = KVLayout.of("bench", dtype_name(payload.blocks.dtype), tuple(payload.blocks.shape[1:]))
        headers, data = payload_to_put(payload, layout, tail_key="")
        client.put_blocks(headers, data)
        put_s += time.perf_counter() - t
        t = time.perf_counter()
        got = payload_from_batches(client.get_blocks(payload.block_hashes), payload.block_hashes, layout).payload
        get_s += time.perf_counter() - t
        assert got is not None and got.num_blocks == payload.num_blocks
    assert torch.equal(got.blocks, payload.blocks)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    payload = make_payload(args.num_blocks, seed=0)
    num_bytes = payload.blocks.numel() * payload.blocks.element_size()
    raw = raw_socket_mbps(payload.blocks.numpy().tobytes(), args.repeats)
    print(json.dumps({"path": "raw loopback TCP (send + echo)", "mb_s": round(raw, 1), "bytes": num_bytes}))
    redis_proc, redis_url = start_redis()
    mooncake = MooncakeCluster(Path(tempfile.mkdtemp(prefix="bench-mooncake-")),
                               segment_bytes=8 * num_bytes).start_all()
    paths = [("mooncake", "mooncake", store_mbps), ("memory", "grpc", store_mbps), ("memory", "ucx", store_mbps),
             (redis_url, "grpc", store_mbps), ("memory", "grpc", store_mbps_per_block)]
    try:
        for backend, transport, measure in paths:
            store = serve(KVStoreConfig(capacity_bytes=4 * num_bytes, metrics_port=None, backend=backend,
                                        ucx_port=0 if transport == "ucx" else None,
                                        mooncake=mooncake.settings if backend == "mooncake" else None))
            client = KVStoreClient(store.address, transport=transport)
            try:
                measure(client, payload, 1)  # untimed: connect, and let gRPC's flow control windows grow
                put, get = measure(client, payload, args.repeats)
                breakdown = mooncake_breakdown(client, payload, args.repeats) if backend == "mooncake" else {}
            finally:
                client.close()
                store.stop()
            both = 2 / (1 / put + 1 / get)
            name = f"kvstore {backend if backend in ('memory', 'mooncake') else 'redis'} over {transport}"
            print(json.dumps({"path": name + (" (one block per message)" if measure is store_mbps_per_block else ""),
                              "put_mb_s": round(put, 1), "get_mb_s": round(get, 1),
                              "ratio_vs_raw_socket": round(both / raw, 2), **breakdown}))
    finally:
        mooncake.stop()
        redis_proc.terminate()
        redis_proc.wait()


if __name__ == "__main__":
    main()
