"""The KVEvents publisher: a snapshot first, then ordered batches; resync when a
subscriber falls behind or the source lost track; close ends every stream; blocks held
and sent per tier, each subscriber getting the tiers it asked for (device alone by default)."""
from __future__ import annotations

import threading

from pdserve.services.common.kv_event_publisher import DEVICE, HOST, REMOVED, STORED, KVEventPublisher


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
    pub.replace([(b"x", DEVICE)])  # the source lost its own log: every subscriber starts over
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


def _tiered(batch):
    return [(e.kind, e.tier, list(e.block_hashes)) for e in batch.events]


def test_tiers_are_held_apart_and_runs_of_one_kind_and_tier_travel_together():
    pub = KVEventPublisher()
    pub.publish_tiered([(STORED, b"a", DEVICE), (STORED, b"b", DEVICE), (STORED, b"c", HOST)])
    stream = pub.stream(lambda: True, tiers=[DEVICE, HOST])
    assert _tiered(next(stream)) == [(STORED, DEVICE, [b"a", b"b"]), (STORED, HOST, [b"c"])]  # one event per tier
    # the device evicts b to host memory, a host block comes back to the device
    pub.publish_tiered([(REMOVED, b"b", DEVICE), (STORED, b"b", HOST), (STORED, b"d", HOST),
                        (STORED, b"c", DEVICE)])
    assert _tiered(next(stream)) == [(REMOVED, DEVICE, [b"b"]), (STORED, HOST, [b"b", b"d"]),
                                     (STORED, DEVICE, [b"c"])]
    assert pub.num_held_by_tier() == {DEVICE: 2, HOST: 3} and pub.num_held == 5
    stream.close()


def test_a_snapshot_holds_each_tier_replace_takes_hash_and_tier():
    pub = KVEventPublisher()
    pub.replace([(b"b", DEVICE), (b"a", DEVICE), (b"h", HOST)])
    stream = pub.stream(lambda: True, tiers=[HOST, DEVICE])
    first = next(stream)
    assert first.snapshot and _tiered(first) == [(STORED, DEVICE, [b"a", b"b"]), (STORED, HOST, [b"h"])]
    pub.replace([(b"h", HOST)])  # the device lost everything it held
    assert _tiered(next(stream)) == [(STORED, HOST, [b"h"])]
    assert pub.num_held_by_tier() == {HOST: 1}
    stream.close()


def test_a_subscriber_naming_no_tier_sees_the_device_alone_with_every_seq():
    """A router from before tiers: host blocks would read to it as device blocks."""
    pub = KVEventPublisher()
    pub.publish_tiered([(STORED, b"a", DEVICE), (STORED, b"h", HOST)])
    old, new = pub.stream(lambda: True), pub.stream(lambda: True, tiers=[DEVICE, HOST])
    assert _tiered(next(old)) == [(STORED, DEVICE, [b"a"])]
    assert _tiered(next(new)) == [(STORED, DEVICE, [b"a"]), (STORED, HOST, [b"h"])]
    pub.publish_tiered([(STORED, b"i", HOST)])  # nothing the old subscriber understands...
    pub.publish([(REMOVED, b"a")])  # (publish: one tier, the device by default, as the kvstore's)
    first, second = next(old), next(old)
    assert (first.seq, _tiered(first)) == (2, [])  # ...yet its seq stays gapless
    assert (second.seq, _tiered(second)) == (3, [(REMOVED, DEVICE, [b"a"])])
    assert [_tiered(next(new)) for _ in range(2)] == [[(STORED, HOST, [b"i"])], [(REMOVED, DEVICE, [b"a"])]]
    old.close()
    new.close()
