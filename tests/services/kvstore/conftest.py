"""Fixtures for the kvstore tests: a real redis-server on a free loopback port, a store of
each backend on a fake clock, and a running service per transport."""
from __future__ import annotations

import contextlib
import shutil
import subprocess
import time

import pytest
import redis

from pdserve.cli.bench.local_platform import free_port_range
from pdserve.services.kvstore.stores.memory import MemoryBlockStore
from pdserve.services.kvstore.stores.redis_store import RedisBlockStore
from pdserve.services.kvstore.server import KVStoreConfig, serve
from pdserve.services.kvstore.stores.base import NULL_EVENTS, StoredBlock, StoreEvents, hash_key, tail_key
from pdserve.engine.core.block_hash import BLOCK_HASH_BYTES
from pdserve.engine.kv_transfer import KVLayout
from pdserve.services.pb import kvstore_pb2
from pdserve.services.worker.kv_integrity import seal

START = 1_700_000_000.0  # the fake clock's epoch: a wall-clock-like value, as Redis leases expect


class FakeClock:
    """Seconds that move only when a test says so: lease expiry without sleeping."""

    def __init__(self):
        self.now = START

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def free_port() -> int:
    return free_port_range(1)  # below the ephemeral range: a process binds it later


@contextlib.contextmanager
def redis_server():
    """A redis-server of our own: no persistence, loopback only, stopped by its PID.
    Yields (url, process)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (apt-get install -y redis-server)")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--maxmemory-policy", "noeviction"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        _wait_for_redis(url, proc)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_url():
    with redis_server() as (url, _):
        yield url


def _wait_for_redis(url: str, proc: subprocess.Popen) -> None:
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            return
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on {url} did not start (exit code {proc.poll()})") from None
            time.sleep(0.02)
        finally:
            client.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=["memory", "redis"])
def make_store(request, clock):
    """make_store(capacity_bytes, events) -> a fresh store of the parametrized backend."""
    stores = []

    def make(capacity_bytes: int, events: StoreEvents = NULL_EVENTS):
        if request.param == "memory":
            store = MemoryBlockStore(capacity_bytes, events, clock=clock)
        else:
            url = request.getfixturevalue("redis_url")
            redis.Redis.from_url(url).flushdb()
            store = RedisBlockStore(url, capacity_bytes, events, clock=clock)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def block(name: str, num_bytes: int = 10, fill: bytes = b"x") -> StoredBlock:
    """A full block keyed by hash `name`, or a tail when `name` starts with "t:"."""
    key = tail_key(name[2:]) if name.startswith("t:") else hash_key(name.encode())
    return StoredBlock(key, b"header:" + name.encode(), fill * num_bytes)


def h(name: bytes) -> bytes:
    """A well-formed block hash (32 bytes) named by a short test name."""
    return name if len(name) == BLOCK_HASH_BYTES else name.ljust(BLOCK_HASH_BYTES, b".")


def wire_block(block_hash: bytes = b"", tail: str = "", num_layers: int = 2, block_size: int = 4,
               fill: int = 1) -> kvstore_pb2.KVBlock:
    """A valid, sealed float16 block on the wire: [layers, 2, block_size, 1 head, 2 dims],
    under h(block_hash) (or the tail key)."""
    shape = [num_layers, 2, block_size, 1, 2]
    layout = KVLayout.of("test-model", "float16", tuple(shape))
    header = kvstore_pb2.KVBlockHeader(block_hash=h(block_hash) if block_hash else b"", tail_key=tail,
                                       dtype="float16", shape=shape, layer_start=0, layer_end=num_layers,
                                       num_tokens=block_size, model_fingerprint=layout.fingerprint,
                                       model_id=layout.model_id)
    data = bytes([fill]) * (num_layers * 2 * block_size * 2 * 2)
    return kvstore_pb2.KVBlock(header=seal(header, data), data=data, found=True)


WIRE_BLOCK_BYTES = len(wire_block(b"x").data)


@pytest.fixture(scope="session")
def mooncake_cluster(tmp_path_factory):
    """A real Mooncake Store (master and one store node) for the whole session."""
    from pdserve.cli.bench.mooncake_cluster import MooncakeCluster
    cluster = MooncakeCluster(tmp_path_factory.mktemp("mooncake"), segment_bytes=128 << 20).start_all()
    yield cluster
    cluster.stop()


@pytest.fixture
def start_kvstore(clock, request):
    """start_kvstore(**config) -> a running service on free loopback ports, on the fake clock.
    In a test parametrized with transport "mooncake", its backend is Mooncake Store."""
    running = []
    callspec = getattr(request.node, "callspec", None)
    mooncake = callspec is not None and callspec.params.get("transport") == "mooncake"

    def start(**overrides):
        defaults = {"capacity_bytes": 1 << 20, "ucx_port": 0, "tcp_port": 0, "metrics_port": None}
        if mooncake:
            defaults.update(backend="mooncake", mooncake=request.getfixturevalue("mooncake_cluster").settings,
                            ucx_port=None, tcp_port=None)
        config = KVStoreConfig(**{**defaults, **overrides})
        running.append(serve(config, clock=clock))
        return running[-1]

    yield start
    for r in running:
        r.stop()
