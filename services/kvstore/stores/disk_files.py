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
The folder is flat: ext4 and xfs index large directories, and a 64 GiB tier of 360 KiB
blocks is some 190,000 files.
"""
from __future__ import annotations

import fcntl
import logging
import os
import struct
import threading
import zlib
from collections import OrderedDict
from typing import BinaryIO

from pdserve.services.kvstore.stores.base import HASH_PREFIX, StoredBlock

logger = logging.getLogger(__name__)

MAGIC, VERSION = b"PDKV", 1
_FIELDS = struct.Struct("<4sHHIQ")  # magic, version, key, header and data lengths
_CRC = struct.Struct("<I")
PREFIX_BYTES = _FIELDS.size + _CRC.size
SUFFIX, TMP_PREFIX, LOCK_NAME = ".kvb", ".tmp-", ".lock"


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


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class BlockFiles:
    """Full blocks as files in `directory`, at most `capacity_bytes` of data (as the memory
    store counts: KV bytes only), least recent evicted first. Thread-safe, with one writer:
    put unlinks what it evicted after letting go of the lock, so two writers could unlink
    a file the other just wrote (DiskTier has one writer thread)."""

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int, fsync: bool = False):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes: {capacity_bytes} must be positive")
        self.directory, self.capacity_bytes, self._fsync = os.fspath(directory), capacity_bytes, fsync
        os.makedirs(self.directory, exist_ok=True)
        self._lock_fd = _lock_folder(self.directory)
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
            _unlink(self._path(key))
        return victims

    def get(self, key: bytes) -> StoredBlock | None:
        """The block, checksum checked, made most recent; None when absent. A broken file
        is deleted and counted (num_corrupt)."""
        with self._lock:
            if key not in self._sizes:
                return None
            self._sizes.move_to_end(key)
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                block = read_block(f, key)
        except FileNotFoundError:  # evicted meanwhile, or removed by hand
            self._forget(key)
            return None
        except OSError as e:  # an I/O error: as good as damaged
            logger.warning("kvstore disk tier: cannot read %s: %s", path, e)
            block = None
        if block is None:
            logger.warning("kvstore disk tier: %s is damaged (size or checksum): deleted", path)
            if self._forget(key):
                self.num_corrupt += 1
            _unlink(path)
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

    # ---- helpers ---------------------------------------------------------------------
    def _path(self, key: bytes) -> str:
        return os.path.join(self.directory, key.hex() + SUFFIX)

    def _write(self, block: StoredBlock) -> None:
        tmp = os.path.join(self.directory, TMP_PREFIX + block.key.hex())
        try:
            with open(tmp, "wb") as f:
                for part in (encode_prefix(block), block.key, block.header, block.data):
                    f.write(part)
                if self._fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, self._path(block.key))
        except OSError:
            _unlink(tmp)
            raise
        if self._fsync:  # the rename itself, durable
            fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _forget(self, key: bytes) -> bool:
        with self._lock:
            size = self._sizes.pop(key, None)
            if size is not None:
                self.used_bytes -= size
            return size is not None

    def _load(self) -> None:
        """The index from the folder: oldest modification first; tmp files (writes cut short)
        and files whose size disagrees with their own lengths deleted; then evicted down to
        the capacity (it may have shrunk since)."""
        found = []
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if entry.name.startswith(TMP_PREFIX):
                    _unlink(entry.path)
                elif entry.name.endswith(SUFFIX) and entry.is_file(follow_symlinks=False):
                    stat = entry.stat(follow_symlinks=False)
                    key, num_bytes = _checked(entry.path, entry.name, stat.st_size)
                    if key is None:
                        self.num_corrupt += 1
                        _unlink(entry.path)
                    else:
                        found.append((stat.st_mtime_ns, entry.name, key, num_bytes))
        for _, _, key, num_bytes in sorted(found):
            self._sizes[key] = num_bytes
            self.used_bytes += num_bytes
        while self.used_bytes > self.capacity_bytes:
            key, size = self._sizes.popitem(last=False)
            self.used_bytes -= size
            _unlink(self._path(key))


def _checked(path: str, name: str, size: int) -> tuple[bytes | None, int]:
    """(key, data bytes) of a block file whose name and size agree with its fixed fields;
    (None, 0) otherwise. Cheap: the fixed fields only, the checksum waits for a read."""
    try:
        key = bytes.fromhex(name.removesuffix(SUFFIX))
        with open(path, "rb") as f:
            fields = f.read(_FIELDS.size)
        magic, version, key_len, header_len, data_len = _FIELDS.unpack(fields)
    except (ValueError, OSError, struct.error):
        return None, 0
    ok = (magic, version, key_len) == (MAGIC, VERSION, len(key)) and key.startswith(HASH_PREFIX) and \
        size == PREFIX_BYTES + key_len + header_len + data_len
    return (key, data_len) if ok else (None, 0)


def _lock_folder(directory: str) -> int:
    """Holds the folder's lock file (released by the kernel when the process dies, even by
    kill -9); a second process on the same folder is refused."""
    fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OSError(f"disk tier folder {directory} is in use by another kvstore process") from None
    return fd


