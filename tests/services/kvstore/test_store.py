"""The BlockStore contract, run against every backend (memory, and a real redis-server):
exact byte accounting, eviction order, pins, leases and their expiry on a fake clock."""
from __future__ import annotations

import pytest

from pdserve.services.kvstore.errors import LeaseNotFound
from pdserve.services.kvstore.stores.base import StoredBlock, StoreEvents, hash_key, tail_key
from tests.services.kvstore.conftest import block


def key(name: str) -> bytes:
    return tail_key(name[2:]) if name.startswith("t:") else hash_key(name.encode())


def held(store, names: str) -> str:
    """Which of the space-separated names the store holds (a get: call it last, it touches)."""
    found = store.get([key(n) for n in names.split()])
    return " ".join(n for n, b in zip(names.split(), found, strict=True) if b is not None)


def put(store, names: str, num_bytes: int = 10, lease_id: str = ""):
    return store.put([block(n, num_bytes) for n in names.split()], lease_id)


def test_put_then_get_returns_the_same_bytes_and_counts_them(make_store):
    store = make_store(100)
    assert store.put([block("a", 10, b"1"), block("t:req", 7, b"2")]) == 2
    found = store.get([key("a"), key("missing"), key("t:req")])
    assert [(b.key, b.header, b.data) if b else None for b in found] == [
        (key("a"), b"header:a", b"1" * 10), None, (key("t:req"), b"header:t:req", b"2" * 7)]
    s = store.stats()
    assert (s.capacity_bytes, s.used_bytes, s.num_blocks, s.num_hits, s.num_misses) == (100, 17, 2, 2, 1)


def test_least_recently_used_is_evicted_first_and_get_refreshes(make_store):
    store = make_store(30)
    put(store, "a b c")
    store.get([key("a")])            # recency now: b c a
    assert put(store, "d") == 1      # evicts b
    assert put(store, "e") == 1      # evicts c
    assert store.stats().num_evictions == 2
    assert store.stats().used_bytes == 30
    assert held(store, "a b c d e") == "a d e"


def test_eviction_frees_exactly_as_many_blocks_as_needed(make_store):
    store = make_store(50)
    put(store, "a b c d e")
    assert put(store, "big", num_bytes=25) == 1  # needs 25: a b c go, d e stay
    assert (store.stats().num_evictions, store.stats().used_bytes) == (3, 45)
    assert held(store, "a b c d e big") == "d e big"


def test_lookup_counts_leading_hashes_and_refreshes_them(make_store):
    store = make_store(30)
    put(store, "a b c")
    assert store.lookup([key("a"), key("b"), key("x"), key("c")]) == 2
    assert store.lookup([key("x"), key("a")]) == 0
    assert store.lookup([]) == 0
    assert store.lookup([key("c"), key("a"), key("b")]) == 3
    store.lookup([key("a")])         # recency now: c b a (the last lookup touched c a b, then a)
    put(store, "d")
    assert held(store, "a b c d") == "a b d"


def test_reput_is_idempotent_keeps_content_and_refreshes(make_store):
    store = make_store(30)
    put(store, "a b c")
    assert store.put([block("a", 10, b"Z")]) == 1  # same hash: same content, stored bytes kept
    s = store.stats()
    assert (s.used_bytes, s.num_blocks, s.num_evictions) == (30, 3, 0)
    put(store, "d")                                 # a was refreshed: b goes
    assert store.get([key("a")])[0].data == b"x" * 10
    assert held(store, "a b c d") == "a c d"


def test_duplicate_keys_in_one_put_are_stored_once_last_wins(make_store):
    store = make_store(100)
    assert store.put([block("t:r", 5, b"1"), block("a"), block("t:r", 8, b"2")]) == 2
    assert store.stats().used_bytes == 18
    assert store.get([key("t:r")])[0].data == b"2" * 8


def test_a_tail_is_overwritten_and_its_size_change_accounted(make_store):
    store = make_store(100)
    put(store, "t:r", num_bytes=10)
    store.put([block("t:r", 25, b"n")])
    assert (store.stats().used_bytes, store.stats().num_blocks) == (25, 1)
    assert store.get([key("t:r")])[0].data == b"n" * 25


def test_a_put_does_not_evict_the_blocks_it_reputs(make_store):
    store = make_store(30)
    put(store, "a b c")
    assert put(store, "a d") == 2    # a is least recent but part of this put: b goes
    assert held(store, "a b c d") == "a c d"


def test_pinned_blocks_are_skipped_by_eviction(make_store):
    store = make_store(30)
    lease = store.create_lease(60_000)
    put(store, "a", lease_id=lease)
    put(store, "b c")
    put(store, "d")                  # a is least recent but pinned: b goes
    assert store.stats().num_pinned_blocks == 1
    assert held(store, "a b c d") == "a c d"


def test_a_put_that_cannot_fit_stores_and_evicts_nothing(make_store):
    store = make_store(30)
    lease = store.create_lease(60_000)
    put(store, "a b", lease_id=lease)
    put(store, "c")
    assert put(store, "d e") is None  # needs 20, only c (10) is evictable
    s = store.stats()
    assert (s.used_bytes, s.num_blocks, s.num_evictions, s.num_pinned_blocks) == (30, 3, 0, 2)
    assert put(store, "huge", num_bytes=31) is None
    assert held(store, "a b c d e huge") == "a b c"


def test_everything_pinned_means_full(make_store):
    store = make_store(20)
    lease = store.create_lease(60_000)
    put(store, "a b", lease_id=lease)
    assert put(store, "c") is None
    assert store.release_lease(lease, drop_tail=False)
    assert put(store, "c") == 1
    assert held(store, "a b c") == "b c"


def test_a_lease_is_released_exactly_once(make_store):
    store = make_store(100)
    lease = store.create_lease(60_000)
    put(store, "a", lease_id=lease)
    assert store.stats().num_active_leases == 1
    assert store.release_lease(lease, drop_tail=True) is True
    assert store.release_lease(lease, drop_tail=True) is False
    assert store.release_lease("never-created", drop_tail=True) is False
    s = store.stats()
    assert (s.num_active_leases, s.num_pinned_blocks, s.num_blocks) == (0, 0, 1)


def test_put_under_an_unknown_or_released_lease_is_refused_and_stores_nothing(make_store):
    store = make_store(100)
    with pytest.raises(LeaseNotFound) as err:
        put(store, "a", lease_id="nope")
    assert err.value.lease_id == "nope" and "lease_id" in err.value.details()
    lease = store.create_lease(60_000)
    store.release_lease(lease, drop_tail=False)
    with pytest.raises(LeaseNotFound):
        put(store, "b", lease_id=lease)
    assert store.stats().num_blocks == 0


def test_an_expired_lease_unpins_and_cannot_be_released_or_used(make_store, clock):
    store = make_store(20)
    lease = store.create_lease(100)
    put(store, "a t:r", lease_id=lease)
    clock.advance(0.099)
    assert store.stats().num_pinned_blocks == 2   # not yet: expiry is at 100 ms
    clock.advance(0.001)
    s = store.stats()
    assert (s.num_active_leases, s.num_pinned_blocks, s.num_blocks) == (0, 0, 2)  # tails stay on expiry
    assert store.release_lease(lease, drop_tail=True) is False
    with pytest.raises(LeaseNotFound):
        put(store, "b", lease_id=lease)
    assert put(store, "c") == 1                   # a is evictable again
    assert held(store, "a t:r c") == "t:r c"


def test_expire_leases_counts_the_leases_it_ends(make_store, clock):
    store = make_store(100)
    short, other = store.create_lease(50), store.create_lease(50)
    long = store.create_lease(5_000)
    store.release_lease(other, drop_tail=False)
    clock.advance(1)
    assert store.expire_leases() == 1            # `other` was released, `long` still runs
    assert store.expire_leases() == 0
    assert store.release_lease(short, drop_tail=False) is False
    assert store.release_lease(long, drop_tail=False) is True


def test_release_with_drop_tail_deletes_only_the_leases_tails(make_store):
    store = make_store(100)
    dropping, keeping = store.create_lease(60_000), store.create_lease(60_000)
    put(store, "a t:one", lease_id=dropping)
    put(store, "b t:two", lease_id=keeping)
    assert store.release_lease(dropping, drop_tail=True)
    assert store.release_lease(keeping, drop_tail=False)
    assert store.stats().used_bytes == 30
    assert held(store, "a t:one b t:two") == "a b t:two"


def test_a_block_pinned_by_two_leases_stays_pinned_until_both_end(make_store):
    store = make_store(100)
    first, second = store.create_lease(60_000), store.create_lease(60_000)
    put(store, "a t:shared", lease_id=first)
    put(store, "a t:shared", lease_id=second)
    put(store, "a", lease_id=first)                      # the same lease pins a block once
    assert store.stats().num_pinned_blocks == 2
    assert store.release_lease(first, drop_tail=True)    # t:shared still pinned by second: kept
    assert store.stats().num_pinned_blocks == 2
    assert held(store, "t:shared") == "t:shared"
    assert store.release_lease(second, drop_tail=True)
    assert store.stats().num_pinned_blocks == 0
    assert held(store, "a t:shared") == "a"


class Recorder(StoreEvents):
    def __init__(self):
        self.seen = []

    def evictions(self, n): self.seen.append(("evictions", n))
    def put_rejected(self): self.seen.append(("rejected",))
    def leases_expired(self, n): self.seen.append(("expired", n))
    def hits(self, n): self.seen.append(("hits", n))
    def misses(self, n): self.seen.append(("misses", n))


def test_events_report_what_happened(make_store, clock):
    recorder = Recorder()
    store = make_store(20, recorder)
    lease = store.create_lease(10)
    put(store, "a b", lease_id=lease)
    assert put(store, "c") is None
    clock.advance(1)
    assert put(store, "c") == 1
    store.get([key("c"), key("zz")])
    assert recorder.seen == [("evictions", 0), ("rejected",), ("expired", 1), ("evictions", 1),
                             ("hits", 1), ("misses", 1)]


def test_binary_hashes_and_unicode_tail_keys_are_kept_apart(make_store):
    store = make_store(100)
    names = [hash_key(b"\x00\xff:t:"), hash_key(b"\x00\xff"), tail_key("r\u00e9q/tail"), tail_key("\x00")]
    store.put([StoredBlock(k, bytes([i]), bytes([i]) * (i + 1)) for i, k in enumerate(names)])
    assert [(b.header, b.data) for b in store.get(names)] == [(bytes([i]), bytes([i]) * (i + 1)) for i in range(4)]
    assert store.stats().used_bytes == 1 + 2 + 3 + 4
