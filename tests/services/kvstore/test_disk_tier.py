"""The disk tier's files and writer (services/kvstore/stores/disk_files.py, stores/disk_tier.py): exact
bytes back, LRU eviction order by data bytes, damaged files detected and counted, the
index rebuilt from the folder on restart, strays removed, the write-behind queue bounded."""
from __future__ import annotations

import os

import pytest

from pdserve.services.kvstore.stores.disk_files import SUFFIX, BlockFiles
from pdserve.services.kvstore.stores.disk_tier import DiskTier
from pdserve.services.kvstore.stores.base import hash_key
from tests.services.kvstore.conftest import block


def key(name: str) -> bytes:
    return hash_key(name.encode())


def path(folder, name: str) -> str:
    return os.path.join(folder, key(name).hex() + SUFFIX)


def names(files: BlockFiles) -> str:
    """The keys held, least recent first, by test name."""
    return " ".join(k[2:].decode() for k in files.keys())


def test_a_block_comes_back_byte_for_byte_from_its_own_file(tmp_path):
    files = BlockFiles(tmp_path, 100)
    assert files.put(block("a", 10, b"1")) == []
    got = files.get(key("a"))
    assert (got.key, got.header, bytes(got.data)) == (key("a"), b"header:a", b"1" * 10)
    assert files.get(key("missing")) is None
    assert sorted(os.listdir(tmp_path)) == [".lock", key("a").hex() + SUFFIX]  # no tmp file left
    assert (files.used_bytes, files.num_blocks) == (10, 1)
    files.close()


def test_least_recent_goes_first_counting_data_bytes(tmp_path):
    files = BlockFiles(tmp_path, 30)
    for name in "abc":
        files.put(block(name, 10))
    files.get(key("a"))                       # recency now: b c a
    files.touch(key("c"))                     # recency now: b a c
    assert files.put(block("d", 10)) == [key("b")]
    assert files.put(block("big", 20)) == [key("a"), key("c")]
    assert names(files) == "d big" and files.used_bytes == 30
    assert not os.path.exists(path(tmp_path, "a")) and not os.path.exists(path(tmp_path, "b"))
    assert files.put(block("huge", 31)) is None  # above the whole capacity: not written, nothing evicted
    assert names(files) == "d big"
    files.close()


@pytest.mark.parametrize("where", ["data", "header", "length"])
def test_a_damaged_file_is_a_miss_deleted_and_counted(tmp_path, where):
    files = BlockFiles(tmp_path, 100)
    files.put(block("a", 10))
    files.put(block("b", 10))
    raw = bytearray(open(path(tmp_path, "a"), "rb").read())
    at = {"data": len(raw) - 1, "header": len(raw) - 12, "length": 16}[where]
    raw[at] ^= 0x01
    open(path(tmp_path, "a"), "wb").write(raw)
    assert files.get(key("a")) is None
    assert (files.num_corrupt, files.used_bytes, names(files)) == (1, 10, "b")
    assert not os.path.exists(path(tmp_path, "a"))
    assert bytes(files.get(key("b")).data) == b"x" * 10
    files.close()


def test_a_restart_rebuilds_the_index_oldest_first(tmp_path):
    files = BlockFiles(tmp_path, 40)
    for name in "abc":
        files.put(block(name, 10))
    for age, name in enumerate("acb"):  # modified: b (oldest), c, a (newest)
        t = 1_700_000_000 - age * 100
        os.utime(path(tmp_path, name), (t, t))
    files.close()
    again = BlockFiles(tmp_path, 40)
    assert (names(again), again.used_bytes, again.num_blocks) == ("b c a", 30, 3)
    assert again.put(block("d", 20)) == [key("b")]
    assert bytes(again.get(key("c")).data) == b"x" * 10
    again.close()


def test_a_restart_removes_strays_and_files_of_the_wrong_size(tmp_path):
    files = BlockFiles(tmp_path, 100)
    files.put(block("a", 10))
    files.put(block("b", 10))
    files.close()
    with open(path(tmp_path, "b"), "r+b") as f:  # a write cut short
        f.truncate(30)
    (tmp_path / (".tmp-" + key("c").hex())).write_bytes(b"half a block")
    (tmp_path / "notes.txt").write_text("not ours")
    again = BlockFiles(tmp_path, 100)
    assert (names(again), again.num_corrupt) == ("a", 1)
    assert sorted(os.listdir(tmp_path)) == [".lock", key("a").hex() + SUFFIX, "notes.txt"]
    again.close()


def test_a_smaller_capacity_on_restart_evicts_the_oldest(tmp_path):
    files = BlockFiles(tmp_path, 100)
    for i, name in enumerate("abc"):
        files.put(block(name, 10))
        os.utime(path(tmp_path, name), (1_700_000_000 + i, 1_700_000_000 + i))
    files.close()
    again = BlockFiles(tmp_path, 20)
    assert (names(again), again.used_bytes) == ("b c", 20)
    assert not os.path.exists(path(tmp_path, "a"))
    again.close()


def test_a_second_owner_of_the_folder_is_refused(tmp_path):
    files = BlockFiles(tmp_path, 100)
    with pytest.raises(OSError, match="in use by another kvstore"):
        BlockFiles(tmp_path, 100)
    files.close()
    BlockFiles(tmp_path, 100).close()  # free again once the first let go


def test_the_writer_writes_full_blocks_only_and_reports_evictions(tmp_path):
    tier = DiskTier(tmp_path, 20)
    dropped = []
    tier.start(dropped.extend)
    for b in (block("a"), block("t:req"), block("b")):
        tier.write_behind(b)
    tier.flush()
    for b in (block("a"), block("c")):  # a is held: only touched, so b is the least recent
        tier.write_behind(b)
    tier.flush()
    assert names(tier.files) == "a c" and dropped == [key("b")]
    s = tier.stats()
    assert (s.num_writes, s.num_skipped_writes, s.used_bytes, s.num_blocks) == (3, 0, 20, 2)
    assert [b is not None for b in tier.read([key("a"), key("b"), key("t:req")])] == [True, False, False]
    assert tier.stats().num_hits == 1
    tier.close()


def test_a_full_queue_skips_the_block_and_a_queued_block_reads_from_the_queue(tmp_path):
    tier = DiskTier(tmp_path, 100, max_queued_bytes=25)  # not started: nothing leaves the queue
    for name in "abc":
        tier.write_behind(block(name, 10))
    assert [tier.holds(key(n)) for n in "abc"] == [True, True, False]
    assert tier.stats().num_skipped_writes == 1
    assert bytes(tier.read([key("b")])[0].data) == b"x" * 10
    assert tier.files.num_blocks == 0
    tier.close()
