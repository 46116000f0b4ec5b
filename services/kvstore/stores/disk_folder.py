"""The disk tier's folder (services/kvstore/stores/disk_files.py) and the only fence around its
files: a block file in it is served to whatever prompt hashes to its name, so nobody but
this process's user (and root) may read, plant or replace one.

    the folder at start:
      missing ─────────────────────────────────────────────▶ created 0700
      a symlink, not a directory, another user's, writable
      by group or others ──────────────────────────────────▶ refused (DiskFolderError)
      ours, readable by others (0755, as pdserve made it
      before issue 49) ────────────────────────────────────▶ tightened to 0700, logged

The folder is opened once (O_DIRECTORY | O_NOFOLLOW) and checked through that descriptor;
every file operation after is relative to it (dir_fd=), so renaming or replacing the path
later cannot redirect a read or a write. Files are created 0600 and never through a name
already there (O_EXCL | O_NOFOLLOW), and opened for reading only when they are regular
files of this process's user: a symlink planted under a block's name is not followed.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
from collections.abc import Iterator
from typing import BinaryIO

logger = logging.getLogger(__name__)

_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # O_NONBLOCK: a planted FIFO does not hang
_OTHERS = 0o077  # the group's and others' bits
LOCK_NAME = ".lock"


class DiskFolderError(OSError):
    """A folder the disk tier will not use: "PATH: what is wrong (and what to do)"."""


class NotOurs(OSError):
    """A name in the folder that is not a regular file of this process's user."""


class Folder:
    """The folder at `path`, created 0700 when missing, checked and held open; its files by
    name only (no method takes a path)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        _make(self.path)
        self.fd = _open_checked(self.path)

    def create(self, name: str) -> BinaryIO:
        """A new file `name`, 0600, for writing. What is there already (a tmp file a crash
        left, or one planted: a symlink to a file elsewhere) is unlinked, never followed,
        and the create tried once more."""
        try:
            fd = os.open(name, _CREATE, 0o600, dir_fd=self.fd)
        except FileExistsError:
            self.unlink(name)
            fd = os.open(name, _CREATE, 0o600, dir_fd=self.fd)
        return open(fd, "wb")

    def open_ours(self, name: str) -> BinaryIO:
        """`name` for reading; NotOurs when it is a symlink, not a regular file or another
        user's (whoever could write the folder once could have planted it)."""
        try:
            fd = os.open(name, _READ, dir_fd=self.fd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise NotOurs(f"{self.shown(name)}: a symlink, not followed") from None
            raise
        st, uid = os.fstat(fd), os.geteuid()
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
            os.close(fd)
            raise NotOurs(f"{self.shown(name)}: not a regular file of uid {uid} (mode {st.st_mode:o}, "
                          f"uid {st.st_uid})")
        return open(fd, "rb")

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def unlink(self, name: str) -> None:
        """Removes `name` (a symlink itself, not its target); gone already is fine."""
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass

    def entries(self) -> Iterator[os.DirEntry]:
        """The folder's entries (a context manager too, as os.scandir's)."""
        return os.scandir(self.fd)

    def sync(self) -> None:
        """Makes the renames and unlinks so far durable."""
        os.fsync(self.fd)

    def lock(self) -> int:
        """Holds the folder's lock file (released by the kernel when the process dies, even
        by kill -9); a second process on the same folder is refused."""
        fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OSError(f"disk tier folder {self.path} is in use by another kvstore process") from None
        return fd

    def shown(self, name: str) -> str:
        """`name` as a path, for messages only."""
        return os.path.join(self.path, name)

    def close(self) -> None:
        os.close(self.fd)


def tighten(f: BinaryIO) -> bool:
    """Takes the group's and others' bits off an open file of ours (older pdserve versions
    wrote 0644); True when it had some."""
    mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)
    if not mode & _OTHERS:
        return False
    os.fchmod(f.fileno(), mode & ~_OTHERS)
    return True


def _make(path: str) -> None:
    # The parents are not the fence: the folder's owner and mode are, checked on its descriptor.
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass


def _open_checked(path: str) -> int:
    try:
        fd = os.open(path, _FOLDER)
    except OSError as e:
        raise DiskFolderError(f"{path}: {_not_a_folder(path, e)}") from None
    try:
        _check(path, fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _not_a_folder(path: str, error: OSError) -> str:
    if os.path.islink(path):
        return f"a symlink (to {os.readlink(path)}); give the folder itself"
    return "not a directory" if error.errno == errno.ENOTDIR else error.strerror


def _check(path: str, fd: int) -> None:
    """On the descriptor, not the path: what is checked is what is used."""
    st, uid = os.fstat(fd), os.geteuid()
    if st.st_uid != uid:
        raise DiskFolderError(f"{path}: owned by uid {st.st_uid}, not this process's {uid}")
    mode = stat.S_IMODE(st.st_mode)
    if writers := [who for who, bit in (("group", 0o020), ("others", 0o002)) if mode & bit]:
        raise DiskFolderError(f"{path}: mode {mode:04o}: writable by {' and '.join(writers)}; chmod 700 it")
    if mode & _OTHERS:
        os.fchmod(fd, mode & ~_OTHERS)
        logger.warning("kvstore disk tier: %s was mode %04o, readable by others (as pdserve made it before "
                       "issue 49): now %04o", path, mode, mode & ~_OTHERS)
