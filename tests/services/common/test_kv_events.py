"""The KVEvents publisher: a snapshot first, then ordered batches; resync when a
subscriber falls behind or the source lost track; close ends every stream."""
from __future__ import annotations

import threading

from services.common.kv_events import REMOVED, STORED, KVEventPublisher


def _kinds(batch):
    return [(e.kind, list(e.block_hashes)) for e in batch.events]


def test_snapshot_first_then_changes_in_order_coalesced():
    pub = KVEventPublisher(block_size=16, root_hash=b"r")
    pub.publish([(STORED, b"a"), (STORED, b"b")])
    stream = pub.stream(lambda: True)
    first = next(stream)
    assert first.snapshot and first.seq == 1 and first.block_size == 16 and first.root_hash == b"r"
    assert _kinds(first) == [(STORED, [b"a", b"b"])]
    pub.publish([(STORED, b"c"), (STORED, b"d"), (REMOVED, b"a"), (STORED, b"a")])
    second = next(stream)
    assert not second.snapshot and second.seq == 2 and second.source_id == first.source_id
    assert _kinds(second) == [(STORED, [b"c", b"d"]), (REMOVED, [b"a"]), (STORED, [b"a"])]
    pub.publish([(REMOVED, b"b")])
    assert next(stream).seq == 3
    assert pub.num_held == 3
    stream.close()


def test_a_subscriber_that_falls_behind_gets_a_snapshot():
    pub = KVEventPublisher(max_pending=2)
    stream = pub.stream(lambda: True)
    assert next(stream).snapshot
    for h in (b"a", b"b", b"c"):
        pub.publish([(STORED, h)])
    resync = next(stream)
    assert resync.snapshot and resync.seq == 3 and _kinds(resync) == [(STORED, [b"a", b"b", b"c"])]
    pub.replace([b"x"])  # the source lost its own log: every subscriber starts over
    assert _kinds(next(stream)) == [(STORED, [b"x"])]
    stream.close()


def test_close_ends_open_streams():
    pub = KVEventPublisher()
    got = []
    stream = pub.stream(lambda: True, poll_s=0.05)
    t = threading.Thread(target=lambda: got.extend(stream))
    t.start()
    pub.close()
    t.join(timeout=5)
    assert not t.is_alive() and len(got) <= 1
