"""The disk tier's folder as its files' only fence (services/kvstore/stores/disk_folder.py),
with real files: modes whatever the umask, folders refused (another uid's, writable by
group or others, a symlink, not a directory), older 0755/0644 tightened, nothing followed
through a planted symlink (`.tmp-<key>` or `<key>.kvb`), another uid's file never served,
and writes that stay in the folder opened even when its path is moved away."""
from __future__ import annotations

import logging
import os
import shutil
import stat
import time

import pytest

from pdserve.services.kvstore.stores.disk_files import SUFFIX, TMP_PREFIX, BlockFiles
from pdserve.services.kvstore.stores.disk_folder import DiskFolderError
from pdserve.services.kvstore.stores.base import hash_key
from tests.services.kvstore.conftest import block
from tests.services.kvstore.test_disk_tier import key, names, path

OTHER_UID = 1234  # a made-up user: root can chown to it


def mode(p) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


@pytest.fixture
def no_umask():
    """umask 0: a mode that comes out 0700/0600 is the code's, not the umask's."""
    old = os.umask(0)
    yield
    os.umask(old)


def test_a_new_folder_is_0700_and_its_files_0600_whatever_the_umask(tmp_path, no_umask):
    folder = tmp_path / "a" / "kv"
    files = BlockFiles(folder, 100)
    files.put(block("a", 10))
    assert (mode(folder), mode(path(folder, "a")), mode(folder / ".lock")) == (0o700, 0o600, 0o600)
    open(tmp_path / "control", "w").close()  # the same umask, a plain open: 0666
    assert mode(tmp_path / "control") == 0o666
    files.close()


def test_an_older_0755_folder_and_its_0644_files_are_tightened_and_still_served(tmp_path, caplog):
    folder = tmp_path / "kv"
    files = BlockFiles(folder, 100)
    files.put(block("a", 10, b"1"))
    files.close()
    os.chmod(folder, 0o755)  # as pdserve made them before issue 49
    os.chmod(path(folder, "a"), 0o644)
    with caplog.at_level(logging.WARNING):
        again = BlockFiles(folder, 100)
    assert (mode(folder), mode(path(folder, "a"))) == (0o700, 0o600)
    assert "was mode 0755, readable by others" in caplog.text and "1 block files" in caplog.text
    assert bytes(again.get(key("a")).data) == b"1" * 10
    again.close()


def test_a_folder_owned_by_another_uid_is_refused(tmp_path):
    folder = tmp_path / "kv"
    folder.mkdir(mode=0o700)
    os.chown(folder, OTHER_UID, OTHER_UID)
    with pytest.raises(DiskFolderError, match=f"kv: owned by uid {OTHER_UID}, not this process's {os.geteuid()}$"):
        BlockFiles(folder, 100)
    assert os.listdir(folder) == []  # not even a lock file
    os.chown(folder, os.geteuid(), os.getegid())  # control: ours, the same folder is taken
    BlockFiles(folder, 100).close()


@pytest.mark.parametrize("folder_mode,who", [
    pytest.param(0o770, "group", id="0770"), pytest.param(0o702, "others", id="0702"),
    pytest.param(0o777, "group and others", id="0777"), pytest.param(0o1777, "group and others", id="1777 as /tmp")])
def test_a_folder_writable_by_group_or_others_is_refused_and_left_as_it_is(tmp_path, folder_mode, who):
    folder = tmp_path / "kv"
    folder.mkdir()
    os.chmod(folder, folder_mode)
    with pytest.raises(DiskFolderError, match=f"mode {folder_mode:04o}: writable by {who}; chmod 700 it"):
        BlockFiles(folder, 100)
    assert mode(folder) == folder_mode
    os.chmod(folder, 0o700)  # control
    BlockFiles(folder, 100).close()


def test_a_symlink_or_a_file_as_the_folder_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(DiskFolderError, match="link: a symlink .*; give the folder itself"):
        BlockFiles(tmp_path / "link", 100)
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(DiskFolderError, match="file: not a directory"):
        BlockFiles(tmp_path / "file", 100)
    assert os.listdir(real) == []
    BlockFiles(real, 100).close()  # control: the folder itself


def test_a_tmp_symlink_pointing_outside_is_not_followed(tmp_path):
    folder, outside = tmp_path / "kv", tmp_path / "outside"
    outside.write_bytes(b"someone else's file")
    files = BlockFiles(folder, 100)
    tmp = folder / (TMP_PREFIX + key("a").hex())
    tmp.symlink_to(outside)
    files.put(block("a", 10, b"1"))
    assert outside.read_bytes() == b"someone else's file"
    assert not os.path.lexists(tmp) and stat.S_ISREG(os.lstat(path(folder, "a")).st_mode)
    assert bytes(files.get(key("a")).data) == b"1" * 10
    (folder / (TMP_PREFIX + key("b").hex())).write_bytes(b"a write a crash cut short")  # control: a plain leftover
    files.put(block("b", 10, b"2"))
    assert bytes(files.get(key("b")).data) == b"2" * 10
    files.close()


def _give_away(p) -> None:
    """`p` replaced by a file with the same (valid) bytes that another uid owns."""
    raw = open(p, "rb").read()
    os.unlink(p)
    with open(p, "wb") as f:
        f.write(raw)
    os.chown(p, OTHER_UID, OTHER_UID)


@pytest.mark.parametrize("when", ["at restart", "at read"])
def test_a_block_file_replaced_by_another_uids_is_refused(tmp_path, when):
    folder = tmp_path / "kv"
    files = BlockFiles(folder, 100)
    files.put(block("a", 10))
    files.put(block("b", 10))
    if when == "at restart":
        files.close()
        _give_away(path(folder, "a"))
        files = BlockFiles(folder, 100)
        assert names(files) == "b"
    else:
        _give_away(path(folder, "a"))
        assert files.get(key("a")) is None
    assert (files.num_corrupt, files.used_bytes) == (1, 10)
    assert not os.path.exists(path(folder, "a"))
    assert bytes(files.get(key("b")).data) == b"x" * 10  # control: a file of ours
    files.close()


@pytest.mark.parametrize("when", ["at restart", "at read"])
def test_a_planted_block_symlink_is_not_followed(tmp_path, when):
    folder, outside = tmp_path / "kv", tmp_path / "outside.kvb"
    files = BlockFiles(folder, 100)
    files.put(block("a", 10, b"1"))
    shutil.copy(path(folder, "a"), outside)  # a valid block file: only the symlink stands in its way
    if when == "at restart":
        files.close()
    os.unlink(path(folder, "a"))
    os.symlink(outside, path(folder, "a"))
    if when == "at restart":
        files = BlockFiles(folder, 100)
        assert names(files) == ""
    else:
        assert files.get(key("a")) is None
    assert (files.num_corrupt, files.num_blocks) == (1, 0)
    assert not os.path.lexists(path(folder, "a")) and outside.exists()
    os.replace(outside, path(folder, "a"))  # control: the same bytes as a file of ours are served
    files.close()
    again = BlockFiles(folder, 100)
    assert bytes(again.get(key("a")).data) == b"1" * 10
    again.close()


def test_a_fifo_under_a_blocks_name_is_a_miss_not_a_hang(tmp_path):
    folder = tmp_path / "kv"
    files = BlockFiles(folder, 100)
    files.put(block("a", 10))
    os.unlink(path(folder, "a"))
    os.mkfifo(path(folder, "a"), 0o600)
    started = time.monotonic()
    assert files.get(key("a")) is None
    assert time.monotonic() - started < 5 and files.num_corrupt == 1
    files.close()


def test_at_start_names_not_ours_go_and_folders_stay(tmp_path):
    folder = tmp_path / "kv"
    BlockFiles(folder, 100).close()
    os.mkfifo(folder / (hash_key(b"fifo").hex() + SUFFIX))
    os.symlink("/etc/passwd", folder / (hash_key(b"link").hex() + SUFFIX))
    (folder / (TMP_PREFIX + "x")).mkdir()
    (folder / ("sub" + SUFFIX)).mkdir()
    files = BlockFiles(folder, 100)
    assert (files.num_corrupt, files.num_blocks) == (2, 0)
    assert sorted(os.listdir(folder)) == [".lock", TMP_PREFIX + "x", "sub" + SUFFIX]
    files.close()


def test_writes_land_in_the_folder_opened_after_its_path_moves(tmp_path):
    folder, moved = tmp_path / "kv", tmp_path / "moved"
    files = BlockFiles(folder, 20)
    files.put(block("a", 10))
    os.rename(folder, moved)
    folder.mkdir(mode=0o700)  # a new folder at the old path: never written or read
    files.put(block("b", 10))
    assert files.put(block("c", 10)) == [key("a")]
    assert sorted(os.listdir(moved)) == sorted([".lock", key("b").hex() + SUFFIX, key("c").hex() + SUFFIX])
    assert os.listdir(folder) == []
    assert bytes(files.get(key("b")).data) == b"x" * 10
    files.close()
