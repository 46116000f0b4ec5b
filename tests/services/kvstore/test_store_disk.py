"""MemoryBlockStore over a disk tier: a block evicted from memory is read back from disk
and promoted (pinned by a lookup's lease like any other), tails stay in memory, and the
KV events keep meaning "the store holds it": memory or disk."""
from __future__ import annotations

import os

import pytest

from pdserve.services.common.kv_event_publisher import KVEventPublisher
from pdserve.services.kvstore.stores.disk_files import SUFFIX
from pdserve.services.kvstore.stores.disk_tier import DiskTier
from pdserve.services.kvstore.block_events import PublishingMetrics
from pdserve.services.kvstore.stores.memory import MemoryBlockStore
from pdserve.services.kvstore.stores.base import StoreEvents, hash_key, tail_key
from tests.services.kvstore.conftest import block


def key(name: str) -> bytes:
    return tail_key(name[2:]) if name.startswith("t:") else hash_key(name.encode())


class Changes(StoreEvents):
    """blocks_changed as "-a +b" words, in order."""

    def __init__(self):
        self.log: list[str] = []

    def blocks_changed(self, evicted, stored):
        self.log += [f"-{k[2:].decode()}" for k in evicted] + [f"+{k[2:].decode()}" for k in stored]

    def take(self) -> str:
        words, self.log = " ".join(self.log), []
        return words


@pytest.fixture
def make(tmp_path):
    """make(memory_bytes, disk_bytes, events) -> a store over a disk tier in tmp_path."""
    stores = []

    def make_store(memory_bytes: int, disk_bytes: int = 100, events: StoreEvents | None = None):
        store = MemoryBlockStore(memory_bytes, events or StoreEvents(), disk=DiskTier(tmp_path, disk_bytes))
        stores.append(store)
        return store

    yield make_store
    for store in stores:
        store.close()


def put(store, names: str, lease_id: str = "", fill: bytes = b"x"):
    """Puts the blocks, then waits for the disk writer, so a test sees the disk settled."""
    result = store.put([block(n, 10, fill) for n in names.split()], lease_id)
    store._disk.flush()
    return result


def in_memory(store) -> str:
    return " ".join(k[2:].decode() for k in store._entries)


def test_a_block_evicted_from_memory_is_read_back_from_disk_and_promoted(make):
    store = make(20)
    put(store, "a b", fill=b"1")
    put(store, "c")                                   # memory evicts a; the disk still has it
    assert in_memory(store) == "b c"
    (got,) = store.get([key("a")])
    assert (got.key, got.header, bytes(got.data)) == (key("a"), b"header:a", b"1" * 10)
    assert in_memory(store) == "c a"                  # promoted, b evicted for it
    s = store.stats()
    assert (s.num_hits, s.num_misses, s.num_evictions) == (1, 0, 2)
    assert (s.disk.num_hits, s.disk.num_writes, s.disk.num_blocks, s.disk.used_bytes) == (1, 3, 3, 30)
    assert store.get([key("missing")]) == [None] and store.stats().num_misses == 1


def test_lookup_promotes_the_disk_part_of_the_prefix_and_pins_it(make):
    store = make(30)
    put(store, "a b c")
    put(store, "d e f")                               # memory: d e f; disk: all six
    lease = store.create_lease(10_000)
    assert store.lookup([key(n) for n in "a b x".split()], lease) == 2
    assert in_memory(store) == "f a b" and store.stats().num_pinned_blocks == 2
    put(store, "g")                                   # a and b are pinned: f goes
    assert in_memory(store) == "a b g"
    assert store.lookup([key(n) for n in "a b c d".split()]) == 4  # no lease: found, c d promoted unpinned
    assert store.stats().num_pinned_blocks == 2


def test_a_get_with_no_room_in_memory_still_serves_from_disk(make):
    store = make(10)
    put(store, "a")
    lease = store.create_lease(10_000)
    put(store, "b", lease_id=lease)                   # memory: b, pinned; a on disk only
    (got,) = store.get([key("a")])                    # no room: served, not promoted
    assert bytes(got.data) == b"x" * 10 and in_memory(store) == "b"
    assert store.lookup([key("a")], lease) == 0       # a lookup pins, so it needs memory


def test_tails_never_reach_the_disk(make, tmp_path):
    store = make(30)
    put(store, "a t:req")
    assert [n for n in os.listdir(tmp_path) if n.endswith(SUFFIX)] == [key("a").hex() + SUFFIX]
    put(store, "b c d")                               # memory evicts a and t:req; t:req is gone
    assert [b is not None for b in store.get([key("a"), key("t:req")])] == [True, False]


def test_events_report_what_memory_or_disk_holds(make):
    changes = Changes()
    store = make(20, disk_bytes=20, events=changes)
    lease = store.create_lease(10_000)
    put(store, "a", lease_id=lease)
    put(store, "b")
    assert changes.take() == "+a +b"                  # memory: a(pinned) b; disk: a b
    put(store, "c")                                   # memory evicts b, on disk: no event; the disk
    assert changes.take() == "+c"                     # evicts a, in memory: no event either
    put(store, "b")                                   # b from the disk: not new to the store; memory
    assert changes.take() == ""                       # evicts c, on disk. memory: a(pinned) b; disk: c b
    store.release_lease(lease, drop_tail=False)
    put(store, "d")                                   # memory evicts a, on no disk: removed; the disk
    assert changes.take() == "-a +d -c"               # evicts c, in no memory: removed
    assert in_memory(store) == "b d" and [k[2:] for k in store._disk.files.keys()] == [b"b", b"d"]


def test_a_damaged_file_is_a_miss_counted_and_reported_removed(make, tmp_path):
    changes = Changes()
    store = make(10, events=changes)
    put(store, "a")
    put(store, "b")                                   # a on disk only
    changes.take()
    with open(os.path.join(tmp_path, key("a").hex() + SUFFIX), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"!")
    assert store.get([key("a")]) == [None]
    assert changes.take() == "-a"
    s = store.stats()
    assert (s.num_misses, s.disk.num_corrupt, s.disk.num_blocks) == (1, 1, 1)


def test_a_restart_on_the_folder_holds_and_publishes_the_blocks_again(tmp_path):
    first = MemoryBlockStore(100, disk=DiskTier(tmp_path, 100))
    first.put([block("a", 10, b"1"), block("b", 10, b"2"), block("t:req", 10)])
    first.close()                                     # writes what is queued
    publisher = KVEventPublisher()
    again = MemoryBlockStore(100, PublishingMetrics(publisher), disk=DiskTier(tmp_path, 100))
    assert publisher.num_held == 2                    # the first snapshot a router gets has them
    assert again.lookup([key("a"), key("b"), key("t:req")]) == 2
    assert [bytes(b.data) for b in again.get([key("a"), key("b")])] == [b"1" * 10, b"2" * 10]
    again.close()


def test_the_disk_tier_has_its_metrics_and_a_memory_store_none(tmp_path):
    from prometheus_client import generate_latest

    from pdserve.services.kvstore.kv_metrics import KVStoreMetrics

    metrics = KVStoreMetrics()
    store = MemoryBlockStore(10, metrics, disk=DiskTier(tmp_path / "kv", 100))
    metrics.watch(store.stats)
    put(store, "a")
    put(store, "b")
    store.get([key("a")])
    text = generate_latest(metrics.metrics.registry).decode()
    for sample in ("pdserve_kvstore_disk_used_bytes 20.0", "pdserve_kvstore_disk_blocks 2.0",
                   "pdserve_kvstore_disk_capacity_bytes 100.0", "pdserve_kvstore_disk_hits_total 1.0",
                   "pdserve_kvstore_disk_writes_total 2.0", "pdserve_kvstore_disk_writes_skipped_total 0.0",
                   "pdserve_kvstore_disk_write_errors_total 0.0", "pdserve_kvstore_disk_corrupt_blocks_total 0.0",
                   "pdserve_kvstore_hits_total 1.0"):
        assert sample in text.splitlines(), sample
    store.close()
    memory_only = KVStoreMetrics()
    memory_only.watch(MemoryBlockStore(10).stats)
    assert "disk" not in generate_latest(memory_only.metrics.registry).decode()
