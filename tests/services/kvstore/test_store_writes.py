"""The BlockStore contract added for asynchronous writes (issue 13), on every backend: a
lease's pending write that readers wait for, and a lookup that pins what it finds."""
from __future__ import annotations

import threading
import time

import pytest

from pdserve.services.kvstore.errors import LeaseNotFound
from pdserve.services.kvstore.stores.base import NO_LEASE, WRITE_DONE, WRITE_FAILED, WRITE_PENDING
from tests.services.kvstore.conftest import block
from tests.services.kvstore.test_store import held, key, put


def test_a_lease_without_a_pending_write_is_done_at_once(make_store):
    store = make_store(100)
    lease = store.create_lease(1_000)
    assert store.wait_write(lease, 5.0) == WRITE_DONE
    assert store.end_write(lease, failed=False) is False  # nothing was pending


def test_a_pending_write_ends_once_done_or_failed(make_store):
    store = make_store(100)
    done, failed = store.create_lease(1_000, write_pending=True), store.create_lease(1_000, write_pending=True)
    assert store.wait_write(done, 0.01) == WRITE_PENDING  # the wait timed out
    assert store.end_write(done, failed=False) is True
    assert store.end_write(done, failed=True) is False    # ended already: stays done
    assert store.end_write(failed, failed=True) is True
    assert (store.wait_write(done, 0), store.wait_write(failed, 0)) == (WRITE_DONE, WRITE_FAILED)


def test_a_lease_that_ends_ends_its_wait(make_store, clock):
    store = make_store(100)
    released, expired = store.create_lease(1_000, write_pending=True), store.create_lease(1_000, write_pending=True)
    store.release_lease(released, drop_tail=True)
    clock.advance(2)
    assert (store.wait_write(released, 5.0), store.wait_write(expired, 5.0)) == (NO_LEASE, NO_LEASE)
    assert store.end_write(released, failed=False) is False
    assert store.wait_write("never-created", 5.0) == NO_LEASE


def test_a_waiter_wakes_when_the_write_ends_in_another_thread(make_store):
    store = make_store(100)
    lease = store.create_lease(10_000, write_pending=True)
    seen = {}

    def read():
        start = time.monotonic()
        seen["state"] = store.wait_write(lease, 10.0)
        seen["held"] = held(store, "a t:r")
        seen["waited_s"] = time.monotonic() - start
    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.2)
    assert put(store, "a t:r", lease_id=lease) == 2
    store.end_write(lease, failed=False)
    reader.join(10)
    assert seen["state"] == WRITE_DONE and seen["held"] == "a t:r"
    assert 0.15 < seen["waited_s"] < 5  # it waited for the write, not for its timeout


def test_lookup_under_a_lease_pins_the_prefix_it_finds(make_store):
    store = make_store(30)
    put(store, "a b c")
    lease = store.create_lease(1_000)
    assert store.lookup([key("a"), key("b"), key("x"), key("c")], lease) == 2
    assert store.stats().num_pinned_blocks == 2
    assert store.lookup([key("a")], lease) == 1  # once per lease
    assert store.stats().num_pinned_blocks == 2
    assert store.put([block("big", 20)]) is None  # only c may go: not enough
    assert put(store, "d") == 1                   # c goes
    assert held(store, "a b c d") == "a b d"
    store.release_lease(lease, drop_tail=True)
    assert store.stats().num_pinned_blocks == 0
    assert store.put([block("big", 20)]) == 1


def test_lookup_under_an_unknown_lease_is_refused(make_store):
    store = make_store(30)
    put(store, "a")
    with pytest.raises(LeaseNotFound):
        store.lookup([key("a")], "no-such-lease")
    assert store.stats().num_pinned_blocks == 0


def test_redis_leaves_no_staged_bytes_behind(redis_url, clock):
    # a Put stages its bytes under keys of its own before its script runs: stored,
    # refused for room or for its lease, none may stay
    import redis

    from pdserve.services.kvstore.stores.redis_store import DEFAULT_PREFIX, RedisBlockStore
    redis.Redis.from_url(redis_url).flushdb()
    store = RedisBlockStore(redis_url, 30, clock=clock)
    try:
        assert put(store, "a t:r") == 2
        assert store.put([block("big", 40)]) is None
        with pytest.raises(LeaseNotFound):
            put(store, "b", lease_id="no-such-lease")
        keys = redis.Redis.from_url(redis_url).keys(DEFAULT_PREFIX + "*")
        assert not [k for k in keys if k.startswith((DEFAULT_PREFIX + "s:").encode())]
        assert held(store, "a t:r b big") == "a t:r"
    finally:
        store.close()
