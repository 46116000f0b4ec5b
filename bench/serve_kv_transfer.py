"""KV transfer throughput (issue 7 experiment 5, issue 13): real KV blocks of SmolLM2's
shape put to and read back from the kvstore over each transport and backend, against the
raw loopback TCP throughput of the same bytes measured in the same run.

The paths the workers take: put_blocks from one contiguous payload tensor (as the engine
exports it), get_blocks into a KVPayload tensor (as the decode imports it). The old
one-block-per-message Put/Get is measured once more for comparison. With the Mooncake
backend (a real mooncake_master and store node on loopback, issue 32) the bytes go from
the payload straight to the store node; its line breaks the time down (checksums, the
kvstore's index calls, Mooncake's transfers, buffer registration, the rest), and says
what a store node's first write into its fresh segment pages cost (`cold_*`: measured
before `touch_segments`, which every number after it follows, as on a node that has
served a while). Path `mooncake` is a worker on another host than the store node (every
byte over Mooncake's transfer engine, TCP here); `mooncake-local` a worker beside it (its
dummy client: the bytes move by shared memory and the node's memcpy), the payload in the
shared memory the engine exports into (KVStoreClient.export_buffer), as a worker's is.

    .venv/bin/python -m bench.serve_kv_transfer [--num-blocks 64] [--repeats 3] [--paths mooncake,memory-tcp,...]

The kvstores run in this process, with the allocator settings `pdserve kvstore` gives its
own process (services/kvstore/heap.py: freed memory kept for the next blocks), for every
path alike.

Prints one JSON line per path: medians over the repeats of each direction's MB/s, of raw
TCP's (one send + echo of the same bytes right before each repeat), and of
`ratio_vs_raw_socket`, each repeat's raw round trip over its put + get; `seal_ms` and
`check_ms` (the writer's and reader's checksums, kv_wire.py) per put+get, and
`ratio_without_checksums`, the same put+get less them: what the transport and store cost.

`--seals xxh3,aes-gcm` (the default: both, one line each, the same store in the same
sitting): the unkeyed XXH3 checksum blocks carry without a platform token, and the
AES-256-GCM seal and encryption they carry with one (services/worker/kv_seal.py), where
`seal_ms` is the encryption and `check_ms` includes the decryption.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

from pdserve.cli.bench.mooncake_cluster import MooncakeCluster
from pdserve.engine.dtypes import dtype_name
from pdserve.engine.kv_transfer import KVLayout, KVPayload, as_tensor
from pdserve.services.worker import kv_wire
from pdserve.services.worker.kv_seal import KVKeys
from pdserve.services.worker.kv_wire import block_from_proto, block_to_proto, payload_from_batches, payload_to_put
from pdserve.services.kvstore import heap
from pdserve.services.kvstore.client import KVStoreClient
from pdserve.services.kvstore.server import KVStoreConfig, serve

# SmolLM2-135M: 30 layers, K and V, block of 16 tokens, 3 KV heads of 64, float32
BLOCK_SHAPE = (30, 2, 16, 3, 64)


def make_payload(num_blocks: int, seed: int) -> KVPayload:
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randn((num_blocks, *BLOCK_SHAPE), generator=gen)
    return KVPayload(num_blocks * 16, blocks, [os.urandom(32) for _ in range(num_blocks)])


class RawEcho:
    """A loopback TCP connection to a thread that echoes what it reads: one round_trip()
    sends the bytes and reads them back whole, as a put then a get. Interleaved with the
    store's repeats, so a machine busy with other work slows both alike."""

    def __init__(self, payload: bytes):
        self.payload = payload
        self._server = socket.create_server(("127.0.0.1", 0))
        self._thread = threading.Thread(target=self._echo, daemon=True)
        self._thread.start()
        self._client = socket.create_connection(self._server.getsockname())

    def _echo(self):
        conn, _ = self._server.accept()
        with conn:
            while True:
                data = bytearray()
                while len(data) < len(self.payload):
                    chunk = conn.recv(1 << 20)
                    if not chunk:
                        return
                    data += chunk
                conn.sendall(data)

    def round_trip(self) -> float:
        start = time.perf_counter()
        self._client.sendall(self.payload)
        got = 0
        while got < len(self.payload):
            got += len(self._client.recv(1 << 20))
        return time.perf_counter() - start

    def close(self) -> None:
        self._client.close()
        self._thread.join()
        self._server.close()


def renamed(payload: KVPayload) -> KVPayload:
    """The same bytes under new block hashes: every put writes new blocks, as a prefill does
    (it looks up what is stored and skips it). A put of hashes already stored is cheaper
    than a write on some backends (Mooncake keeps the first object under a key and answers
    a second put of it at once), so repeating one payload would not measure a write."""
    return KVPayload(payload.num_tokens, payload.blocks, [os.urandom(32) for _ in payload.block_hashes])


def store_times(client: KVStoreClient, payload: KVPayload, repeats: int, echo: RawEcho,
                keys: KVKeys | None = None) -> list[tuple[float, ...]]:
    """(raw TCP round trip, put, get) seconds for each repeat: put_blocks then get_blocks of
    the payload, as the workers do (export layout in, a KVPayload tensor out), new hashes
    each time, right after one raw round trip of the same bytes. `keys`: sealed and
    encrypted with them, as a platform with a token does."""
    times = []
    for _ in range(repeats):
        payload = renamed(payload)
        raw_s = echo.round_trip()
        t = time.perf_counter()
        layout = KVLayout.of("bench", dtype_name(payload.blocks.dtype), tuple(payload.blocks.shape[1:]))
        headers, data = payload_to_put(payload, layout, tail_key="", keys=keys, cache_salt="bench",
                                       out=client.export_buffer)  # as the workers do
        client.put_blocks(headers, data)
        put_s = time.perf_counter() - t
        t = time.perf_counter()
        got = payload_from_batches(client.get_blocks(payload.block_hashes), payload.block_hashes, layout,
                                   keys=keys, cache_salt="bench").payload
        times.append((raw_s, put_s, time.perf_counter() - t))
        assert got is not None and got.num_blocks == payload.num_blocks
    assert torch.equal(as_tensor(got.blocks), payload.blocks)
    return times


def store_times_per_block(client: KVStoreClient, payload: KVPayload, repeats: int,
                          echo: RawEcho) -> list[tuple[float, ...]]:
    """The one-block-per-message Put and Get (before issue 13), for comparison: as the
    workers did, the messages are built from the payload and the tensor from the answer."""
    times = []
    for _ in range(repeats):
        payload = renamed(payload)
        raw_s = echo.round_trip()
        t = time.perf_counter()
        client.put([block_to_proto(b, 16, block_hash=h) for b, h in zip(payload.blocks, payload.block_hashes)])
        put_s = time.perf_counter() - t
        t = time.perf_counter()
        got = torch.stack([block_from_proto(b) for b in client.get(payload.block_hashes)])  # as decodes did
        times.append((raw_s, put_s, time.perf_counter() - t))
    assert torch.equal(got, payload.blocks)
    return times


def summary(times: list[tuple[float, ...]], num_bytes: int) -> dict[str, float]:
    """Medians over the repeats: MB/s of each direction, raw TCP's MB/s (both ways), and the
    ratio of the store's put+get to the raw round trip of the same repeat (the harmonic mean
    of put and get MB/s over raw's)."""
    raw, put, get = zip(*times)
    return {"put_mb_s": round(num_bytes / statistics.median(put) / 1e6, 1),
            "get_mb_s": round(num_bytes / statistics.median(get) / 1e6, 1),
            "ratio_vs_raw_socket": round(statistics.median(r / (p + g) for r, p, g in times), 2),
            "raw_mb_s": round(2 * num_bytes / statistics.median(raw) / 1e6, 1)}


class _TimedPlane:
    """The Mooncake client with its calls timed into `spent` (ms, by the name of the call)."""

    def __init__(self, plane, spent: dict[str, float], names: dict[str, str]):
        self._plane, self._spent, self._names = plane, spent, names

    def __getattr__(self, name):
        method = getattr(self._plane, name)
        if name not in self._names:
            return method
        return _timed(self._spent, self._names[name], method)


def _timed(spent: dict[str, float], key: str, method):
    def call(*args, **kwargs):
        t = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent[key] += (time.perf_counter() - t) * 1e3
    return call


def measured(client: KVStoreClient, payload: KVPayload, repeats: int, echo: RawEcho,
             measure=None) -> tuple[list[tuple[float, ...]], dict[str, float]]:
    """`measure` (store_times by default), and where its time went, in ms per put+get (means
    over the repeats): sealing (the writer's checksums) and checking (the reader's: checksums
    and headers); over Mooncake also the kvstore's index calls (gRPC), Mooncake's transfers
    (batch_put_from, batch_get_into), registering buffers with the transfer engine, and the
    rest (headers, object keys, the payload's views)."""
    measure = measure or store_times
    spent = {"seal_ms": 0.0, "check_ms": 0.0}
    patched = [(kv_wire, "seal", "seal_ms"), (kv_wire, "seal_encrypted", "seal_ms"), (kv_wire, "refusal", "check_ms")]
    transport = client._block_transport()
    # Mooncake: the bytes' own path, timed call by call (the local store node's client or the TCP one)
    local = getattr(transport, "local", None)
    owner, attribute = (local, "client") if local is not None else (transport, "_plane")
    plane = getattr(owner, attribute, None) if client.transport == "mooncake" else None
    if plane is not None:
        spent.update(index_ms=0.0, put_transfer_ms=0.0, get_transfer_ms=0.0, register_ms=0.0)
        patched += [(transport._control, "put_blocks", "index_ms"), (transport._control, "get_blocks", "index_ms")]
        setattr(owner, attribute, _TimedPlane(plane, spent, {
            "batch_put_from": "put_transfer_ms", "batch_get_into": "get_transfer_ms",
            "register_buffer": "register_ms", "unregister_buffer": "register_ms", "alloc_from_mem_pool": "register_ms"}))
    originals = [getattr(o, name) for o, name, _ in patched]
    for o, name, key in patched:
        setattr(o, name, _timed(spent, key, getattr(o, name)))
    try:
        times = measure(client, payload, repeats, echo)
    finally:
        for (o, name, _), original in zip(patched, originals):
            setattr(o, name, original)
        if plane is not None:
            setattr(owner, attribute, plane)
    if plane is not None:
        spent["other_ms"] = sum(p + g for _, p, g in times) * 1e3 - sum(spent.values())
    return times, {k: round(v / repeats, 1) for k, v in spent.items()}


def without_checksums(times: list[tuple[float, ...]], breakdown: dict[str, float]) -> float:
    """The median ratio vs raw of the put+get less the seal and check (their mean per repeat)."""
    checks_s = (breakdown["seal_ms"] + breakdown["check_ms"]) / 1e3
    return round(statistics.median(r / max(p + g - checks_s, 1e-9) for r, p, g in times), 2)


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


def in_export_memory(client: KVStoreClient, payload: KVPayload) -> KVPayload:
    """The payload's blocks in the memory the client's transport has the engine export
    into (as EngineCore.set_kv_export_allocator does in a worker); as they are without one."""
    nbytes = payload.blocks.numel() * payload.blocks.element_size()
    client._block_transport()  # connected, as a worker's is by its first put or get
    buffer = client.export_buffer(nbytes)
    if buffer is None:
        raise SystemExit("the Mooncake transport gave no export memory: is the store node on this host?")
    blocks = torch.from_numpy(buffer).view(payload.blocks.dtype).view(payload.blocks.shape)
    blocks.copy_(payload.blocks)
    return KVPayload(payload.num_tokens, blocks, payload.block_hashes)


# how blocks are sealed: without a platform token, and with one (a fixed token: the cost does not depend on it)
SEALS = {"xxh3": None, "aes-gcm": KVKeys.from_token("bench-platform-token")}
# name: (backend, transport, measure); LOCAL: through the store node on this host
LOCAL = {"mooncake-local"}
PATHS = {"mooncake": ("mooncake", "mooncake", store_times), "mooncake-local": ("mooncake", "mooncake", store_times),
         "memory-tcp": ("memory", "tcp", store_times),
         "memory-grpc": ("memory", "grpc", store_times), "memory-ucx": ("memory", "ucx", store_times),
         "redis": ("redis", "grpc", store_times), "memory-grpc-per-block": ("memory", "grpc", store_times_per_block)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--paths", default=",".join(PATHS),
                        help=f"which store paths to measure, of {','.join(PATHS)} (default all)")
    parser.add_argument("--seals", default=",".join(SEALS),
                        help=f"how blocks are sealed, of {','.join(SEALS)}: each measured on the same store")
    args = parser.parse_args()
    seals = args.seals.split(",")
    if unknown := set(seals) - set(SEALS):
        parser.error(f"--seals: {sorted(unknown)} not among {list(SEALS)}")
    chosen = args.paths.split(",")
    if unknown := set(chosen) - set(PATHS):
        parser.error(f"--paths: {sorted(unknown)} not among {list(PATHS)}")
    payload = make_payload(args.num_blocks, seed=0)
    num_bytes = payload.blocks.numel() * payload.blocks.element_size()
    heap.keep_freed_memory(4 * num_bytes)  # as `pdserve kvstore` does for its capacity
    echo = RawEcho(payload.blocks.numpy().tobytes())
    echo.round_trip()
    raw = [echo.round_trip() for _ in range(args.repeats)]
    print(json.dumps({"path": "raw loopback TCP (send + echo)", "mb_s": round(2 * num_bytes / statistics.median(raw)
                                                                             / 1e6, 1), "bytes": num_bytes}))
    redis_proc, redis_url = start_redis() if "redis" in chosen else (None, "")
    paths = [(name, *PATHS[name]) for name in PATHS if name in chosen]
    try:
        for path, backend, transport, measure in paths:
            backend = redis_url if backend == "redis" else backend
            # A Mooncake path on a store of its own: touch_segments fills the segment, and
            # another path's objects there would push the master into evicting this one's.
            # Room for every put of the path (each writes new blocks): the index evicts at 4
            # payloads, but Mooncake refuses to remove an object read in the last seconds (its lease);
            # each seal is measured in two rounds.
            mooncake = MooncakeCluster(Path(tempfile.mkdtemp(prefix="bench-mooncake-")),
                                       segment_bytes=(2 * len(seals) * args.repeats + 6) * num_bytes).start_all() \
                if backend == "mooncake" else None
            store = serve(KVStoreConfig(capacity_bytes=4 * num_bytes, metrics_port=None, backend=backend,
                                        ucx_port=0 if transport == "ucx" else None,
                                        tcp_port=0 if transport == "tcp" else None,
                                        mooncake=mooncake.settings if mooncake is not None else None))
            client = KVStoreClient(store.address, transport=transport,
                                   mooncake_local_node="auto" if path in LOCAL else "off")
            extra, sent = {}, payload
            try:
                sent = in_export_memory(client, payload) if path in LOCAL else payload
                # untimed: connect, and let gRPC's flow control windows grow
                cold = summary(measure(client, sent, 1, echo), num_bytes)
                if mooncake is not None:  # a node's first write into its pages: see touch_segments
                    extra = {"cold_put_mb_s": cold["put_mb_s"], "cold_get_mb_s": cold["get_mb_s"],
                             "segment_touch_s": round(mooncake.touch_segments(), 2)}
                    measure(client, sent, 1, echo)  # the second read buffer (the first is still viewed)
                lines = []
                # every seal twice, in turn, the first round untimed: the store's memory
                # is warm for all alike (the first path measured would pay its page faults)
                rounds = [*seals, *seals] if measure is store_times else ["xxh3"]
                for i, seal in enumerate(rounds):
                    if measure is store_times:
                        sealed = functools.partial(store_times, keys=SEALS[seal])
                        if i < len(seals):
                            sealed(client, sent, args.repeats, echo)
                            continue
                        times, breakdown = measured(client, sent, args.repeats, echo, sealed)
                        lines.append((seal, times, {**breakdown, "ratio_without_checksums":
                                                    without_checksums(times, breakdown), **extra}))
                    else:
                        lines.append((seal, measure(client, sent, args.repeats, echo), extra))
            finally:
                del sent  # the transport's memory, if it was: before the client closes
                client.close()
                store.stop()
                if mooncake is not None:
                    mooncake.stop()
            name = f"kvstore {backend if backend in ('memory', 'mooncake') else 'redis'} over {transport}"
            name += " (the store node on this host: shared memory)" if path in LOCAL else ""
            name += " (one block per message)" if measure is store_times_per_block else ""
            for seal, times, extra in lines:
                print(json.dumps({"path": name, "seal": seal, **summary(times, num_bytes), **extra}))
    finally:
        echo.close()
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait()


if __name__ == "__main__":
    main()
