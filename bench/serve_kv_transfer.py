"""KV transfer throughput (issue 7, experiment 5): real KV blocks of SmolLM2's shape put to
and read back from the kvstore over each transport and backend, against the raw loopback
TCP throughput of the same bytes measured in the same run.

    .venv/bin/python bench/serve_kv_transfer.py [--num-blocks 64] [--repeats 3]

Prints one JSON line per path with MB/s and `ratio_vs_raw_socket`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from services.worker.kv_wire import block_to_proto  # noqa: E402
from services.kvstore.client import KVStoreClient  # noqa: E402
from services.kvstore.server import KVStoreConfig, serve  # noqa: E402

# SmolLM2-135M: 30 layers, K and V, block of 16 tokens, 3 KV heads of 64, float32
BLOCK_SHAPE = (30, 2, 16, 3, 64)


def make_blocks(num_blocks: int, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [block_to_proto(torch.randn(BLOCK_SHAPE, generator=gen), 16, block_hash=os.urandom(32))
            for _ in range(num_blocks)]


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


def store_mbps(client: KVStoreClient, blocks: list, repeats: int) -> tuple[float, float]:
    """Put then get the blocks; MB/s of each direction (bytes of block data)."""
    num_bytes = sum(len(b.data) for b in blocks)
    hashes = [b.header.block_hash for b in blocks]
    put_s = get_s = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        client.put(blocks)
        put_s += time.perf_counter() - t
        t = time.perf_counter()
        got = client.get(hashes)
        get_s += time.perf_counter() - t
        assert all(b.found for b in got)
    return num_bytes * repeats / put_s / 1e6, num_bytes * repeats / get_s / 1e6


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
    blocks = make_blocks(args.num_blocks, seed=0)
    num_bytes = sum(len(b.data) for b in blocks)
    raw = raw_socket_mbps(b"".join(b.data for b in blocks), args.repeats)
    print(json.dumps({"path": "raw loopback TCP (send + echo)", "mb_s": round(raw, 1), "bytes": num_bytes}))
    redis_proc, redis_url = start_redis()
    try:
        for backend, transport in [("memory", "grpc"), ("memory", "ucx"), (redis_url, "grpc")]:
            store = serve(KVStoreConfig(capacity_bytes=4 * num_bytes, metrics_port=None,
                                        backend=backend, ucx_port=0 if transport == "ucx" else None))
            client = KVStoreClient(store.address, transport=transport)
            try:
                put, get = store_mbps(client, blocks, args.repeats)
            finally:
                client.close()
                store.stop()
            both = 2 / (1 / put + 1 / get)
            print(json.dumps({"path": f"kvstore {'redis' if backend != 'memory' else 'memory'} over {transport}",
                              "put_mb_s": round(put, 1), "get_mb_s": round(get, 1),
                              "ratio_vs_raw_socket": round(both / raw, 2)}))
    finally:
        redis_proc.terminate()
        redis_proc.wait()


if __name__ == "__main__":
    main()
