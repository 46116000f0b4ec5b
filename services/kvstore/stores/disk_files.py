"""The disk tier's files (services/kvstore/stores/disk_tier.py): full blocks as checksummed files
in one folder, bounded in bytes, least recently used evicted first.

One file per full block (keys b"h:..."), named by its key in hex, holding

    magic "PDKV" | version u16 | key length u16 | header length u32 | data length u64 | crc32 u32
    key | serialized KVBlockHeader | data

The crc32 covers the fields before it and everything after it. It is there for torn and
rotted files (a write cut by a power loss without fsync, a bad sector), and runs faster
than a disk reads (docs/kvstore.md gives the numbers); a block's own seal (XXH3,
services/worker/kv_integrity.py), which the reader verifies before use, still guards it
end to end. Writes are atomic: a tmp file
in the same folder renamed over the name. On start the folder is scanned: the index is
rebuilt oldest modification first (least recent), tmp files are deleted, and so is a file
whose size disagrees with its own lengths; a checksum failure is found on read (counted,
deleted, a miss). A `.lock` file held with flock keeps a second process off the folder.
The folder is the files' only fence (stores/disk_folder.py): 0700 and this process's
user's, held open, every file 0600 and reached relative to it; a name that is not a
regular file of ours is never read (a damaged file, as far as the index goes).
The folder is flat: ext4 and xfs index large directories, and a 64 GiB tier of 360 KiB
blocks is some 190,000 files.
"""
from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from collections import OrderedDict
from typing import BinaryIO, NamedTuple

from pdserve.services.kvstore.stores.base import HASH_PREFIX, StoredBlock
from pdserve.services.kvstore.stores.disk_folder import Folder, tighten

logger = logging.getLogger(__name__)

MAGIC, VERSION = b"PDKV", 1
_FIELDS = struct.Struct("<4sHHIQ")  # magic, version, key, header and data lengths
_CRC = struct.Struct("<I")
PREFIX_BYTES = _FIELDS.size + _CRC.size
SUFFIX, TMP_PREFIX = ".kvb", ".tmp-"


def encode_prefix(block: StoredBlock) -> bytes:
    """The fixed part of a block's file; key, header and data follow it."""
    fields = _FIELDS.pack(MAGIC, VERSION, len(block.key), len(block.header), len(block.data))
    crc = zlib.crc32(block.data, zlib.crc32(block.header, zlib.crc32(block.key, zlib.crc32(fields))))
    return fields + _CRC.pack(crc)


def read_block(f: BinaryIO, key: bytes) -> StoredBlock | None:
    """The block in an open file of `key` (its data read straight into a bytes of its own);
    None unless the file is whole and intact."""
    fields = f.read(PREFIX_BYTES)
    if len(fields) < PREFIX_BYTES:
        return None
    magic, version, key_len, header_len, data_len = _FIELDS.unpack_from(fields)
    size = os.fstat(f.fileno()).st_size  # checked before reading: a damaged length allocates nothing
    if (magic, version) != (MAGIC, VERSION) or PREFIX_BYTES + key_len + header_len + data_len != size:
        return None
    names, data = f.read(key_len + header_len), f.read(data_len)
    crc = zlib.crc32(data, zlib.crc32(names, zlib.crc32(fields[:_FIELDS.size])))
    if crc != _CRC.unpack_from(fields, _FIELDS.size)[0] or names[:key_len] != key:
        return None
    return StoredBlock(key, names[key_len:], data)


class BlockFiles:
    """Full blocks as files in `directory`, at most `capacity_bytes` of data (as the memory
    store counts: KV bytes only), least recent evicted first. Thread-safe, with one writer:
    put unlinks what it evicted after letting go of the lock, so two writers could unlink
    a file the other just wrote (DiskTier has one writer thread)."""

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int, fsync: bool = False):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes: {capacity_bytes} must be positive")
        self.directory, self.capacity_bytes, self._fsync = os.fspath(directory), capacity_bytes, fsync
        self._folder = Folder(self.directory)
        try:
            self._lock_fd = self._folder.lock()
        except BaseException:
            self._folder.close()
            raise
        self._lock = threading.Lock()
        self._sizes: OrderedDict[bytes, int] = OrderedDict()  # key -> data bytes, least recent first
        self.used_bytes = 0
        self.num_corrupt = 0
        self._load()

    def put(self, block: StoredBlock) -> list[bytes] | None:
        """Writes the block and makes it most recent; returns the keys evicted for it, None
        when it alone exceeds the capacity. An OSError (disk full) leaves everything as it was."""
        num_bytes = len(block.data)
        if num_bytes > self.capacity_bytes:
            return None
        self._write(block)
        with self._lock:
            self.used_bytes += num_bytes - self._sizes.pop(block.key, 0)
            self._sizes[block.key] = num_bytes
            victims = []
            while self.used_bytes > self.capacity_bytes:  # the new block is last: others go first
                key, size = self._sizes.popitem(last=False)
                self.used_bytes -= size
                victims.append(key)
        for key in victims:
            self._folder.unlink(_name(key))
        return victims

    def get(self, key: bytes) -> StoredBlock | None:
        """The block, checksum checked, made most recent; None when absent. A broken file,
        or a name that is not a regular file of ours, is deleted and counted (num_corrupt)."""
        with self._lock:
            if key not in self._sizes:
                return None
            self._sizes.move_to_end(key)
        name = _name(key)
        try:
            with self._folder.open_ours(name) as f:
                block = read_block(f, key)
            problem = f"{self._folder.shown(name)} is damaged (size or checksum)"
        except FileNotFoundError:  # evicted meanwhile, or removed by hand
            self._forget(key)
            return None
        except OSError as e:  # an I/O error, or not ours (NotOurs): as good as damaged
            block, problem = None, f"cannot read {self._folder.shown(name)}: {e}"
        if block is None:
            logger.warning("kvstore disk tier: %s: deleted", problem)
            if self._forget(key):
                self.num_corrupt += 1
            self._folder.unlink(name)
        return block

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._sizes

    def touch(self, key: bytes) -> None:
        """Makes a key most recent, when it is here (a hit in memory is a use of the block)."""
        with self._lock:
            if key in self._sizes:
                self._sizes.move_to_end(key)

    @property
    def num_blocks(self) -> int:
        return len(self._sizes)

    def keys(self) -> list[bytes]:
        """Least recent first."""
        with self._lock:
            return list(self._sizes)

    def close(self) -> None:
        os.close(self._lock_fd)
        self._folder.close()

    # ---- helpers ---------------------------------------------------------------------
    def _write(self, block: StoredBlock) -> None:
        tmp = TMP_PREFIX + block.key.hex()
        try:
            with self._folder.create(tmp) as f:
                for part in (encode_prefix(block), block.key, block.header, block.data):
                    f.write(part)
                if self._fsync:
                    f.flush()
                    os.fsync(f.fileno())
            self._folder.replace(tmp, _name(block.key))
        except OSError:
            self._folder.unlink(tmp)
            raise
        if self._fsync:  # the rename itself, durable
            self._folder.sync()

    def _forget(self, key: bytes) -> bool:
        with self._lock:
            size = self._sizes.pop(key, None)
            if size is not None:
                self.used_bytes -= size
            return size is not None

    def _load(self) -> None:
        """The index from the folder: oldest modification first; tmp files (writes cut short),
        block names that are not regular files of ours and files whose size disagrees with
        their own lengths deleted; files of ours readable by others tightened to 0600; then
        evicted down to the capacity (it may have shrunk since)."""
        found, num_tightened = [], 0
        with self._folder.entries() as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    continue  # not ours to delete, and never read
                if entry.name.startswith(TMP_PREFIX):
                    self._folder.unlink(entry.name)
                elif entry.name.endswith(SUFFIX):
                    if (file := self._checked(entry.name)) is None:
                        self.num_corrupt += 1
                        self._folder.unlink(entry.name)
                    else:
                        found.append(file)
                        num_tightened += file.tightened
        if num_tightened:
            logger.warning("kvstore disk tier: %d block files in %s were readable by others: now 0600",
                           num_tightened, self.directory)
        for file in sorted(found):
            self._sizes[file.key] = file.num_bytes
            self.used_bytes += file.num_bytes
        while self.used_bytes > self.capacity_bytes:
            key, size = self._sizes.popitem(last=False)
            self.used_bytes -= size
            self._folder.unlink(_name(key))

    def _checked(self, name: str) -> _Found | None:
        """A block file whose name and size agree with its fixed fields; None otherwise, or
        when it is not a regular file of ours. Cheap: the fixed fields only, the checksum
        waits for a read."""
        try:
            key = bytes.fromhex(name.removesuffix(SUFFIX))
            with self._folder.open_ours(name) as f:
                fields, stat, tightened = f.read(_FIELDS.size), os.fstat(f.fileno()), tighten(f)
            magic, version, key_len, header_len, data_len = _FIELDS.unpack(fields)
        except (ValueError, OSError, struct.error):
            return None
        ok = (magic, version, key_len) == (MAGIC, VERSION, len(key)) and key.startswith(HASH_PREFIX) and \
            stat.st_size == PREFIX_BYTES + key_len + header_len + data_len
        return _Found(stat.st_mtime_ns, name, key, data_len, tightened) if ok else None


class _Found(NamedTuple):
    """A block file the start-up scan found; sorts oldest modification first."""
    mtime_ns: int
    name: str
    key: bytes
    num_bytes: int
    tightened: bool


def _name(key: bytes) -> str:
    return key.hex() + SUFFIX


