"""What keeps a slot device safe from its neighbours: one server per device (checked early
by the pre-flight's probe too), and no descriptor closed or mapping unmapped under a call
still using it."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

from lmcache_tiers.plugin import ConfigError, FieldError, check_claimed_once

log = logging.getLogger(__name__)


def under_dev(real: str) -> bool:
    """A missing name under /dev is a mistyped device, not a file to create (/dev/shm aside):
    a file made there would live in devtmpfs memory, not on the device meant."""
    parent = os.path.dirname(real) or "."
    return parent == "/dev" or (parent.startswith("/dev/") and not (parent + "/").startswith("/dev/shm/"))


def _in_use(path: str) -> str:
    # The lock tells that the device is held, not by which kind of adapter: raw_block and
    # dax take the same one.
    return (
        f"{path} is in use by another raw_block or dax adapter (this server or another one "
        "holds its lock); give each adapter a device of its own"
    )


def lock_device(fd: int, path: str, type_name: str) -> None:
    """``flock(LOCK_EX)`` on the device itself, held as long as ``fd`` stays open.

    The kernel drops it when the process dies, even by SIGKILL, so a restart after a
    crash is never blocked; a second server (or a second adapter of this one) naming the
    same device, under any path that leads to it, is refused.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ConfigError(f"{type_name}: {_in_use(path)}") from None
    except OSError as exc:
        # Unlocked, a second server could share the device: refused, not run without it.
        raise ConfigError(
            f"{type_name}: cannot lock {path} against a second server: {exc.strerror}"
        ) from None


class _LoopBacking(NamedTuple):
    """The file behind a loop device (or a partition of one) and the bytes of it the
    device reaches: from ``start``, ``length`` of them (0: to the file's end)."""

    path: str
    start: int
    length: int
    whole: bool  # the loop device itself, over the whole file


_SECTOR = 512  # the unit of a partition's start and size in sysfs


def _loop_backing_file(device_fd: int) -> _LoopBacking | None:
    """The file a loop block device (or a partition of one) reads and writes, and its
    part; None: not a loop device, detached, or its file deleted (nothing else can open
    it then).

    A loop device over the whole file takes its ``flock`` exclusively; a partition, or a
    loop device over a part of the file (an offset or a size limit), shares it and locks
    its own bytes (:func:`_lock_part`), so several parts that do not overlap run side by
    side, while two that do, or an adapter naming the file itself, are refused."""
    rdev = os.fstat(device_fd).st_rdev
    node = os.path.realpath(f"/sys/dev/block/{os.major(rdev)}:{os.minor(rdev)}")
    for directory in (node, os.path.dirname(node)):  # a partition's loop is its parent's
        loop = os.path.join(directory, "loop")
        try:
            with open(os.path.join(loop, "backing_file")) as handle:
                backing = handle.read().rstrip("\n")
            start, length = (
                _read_int(os.path.join(loop, "offset")),
                _read_int(os.path.join(loop, "sizelimit")),
            )
            if directory != node:  # a partition: its sectors, from the loop device's offset
                start += _read_int(os.path.join(node, "start")) * _SECTOR
                length = _read_int(os.path.join(node, "size")) * _SECTOR
        except OSError:
            continue
        if backing.endswith(" (deleted)"):
            return None
        whole = directory == node and start == 0 and length == 0
        return _LoopBacking(backing, start, length, whole)
    return None


def _read_int(path: str) -> int:
    with open(path) as handle:
        return int(handle.read().strip() or 0)


def _open_backing(backing: str) -> int:
    """The file behind a loop device, opened to lock it: read-write where this user may
    (a part's own bytes take a write lock, which only such a descriptor can hold)."""
    try:
        return os.open(backing, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return os.open(backing, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)


def _lock_backing(fd: int, found: _LoopBacking) -> None:
    """``flock`` the file behind a loop device -- exclusively for the whole file, shared
    for a part -- and, for a part, an open-file-description write lock on its bytes: held
    as long as ``fd`` stays open, by any process (like ``flock``, and unlike a POSIX
    record lock, not dropped by another descriptor's close).  Raises BlockingIOError
    when another adapter holds the file or overlapping bytes; OSError otherwise."""
    fcntl.flock(fd, (fcntl.LOCK_EX if found.whole else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    if found.whole:
        return
    request = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, found.start, found.length, 0)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, request)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            raise BlockingIOError(exc.errno, exc.strerror) from None
        if exc.errno != errno.EBADF:
            raise
        # Read-only here: no write lock. An adapter on an overlapping part needs this
        # file writable to clash, and would be refused only by its own lock.
        log.warning(
            "%s is not writable here: the bytes %d.. of it a loop device reaches are not locked "
            "against another loop device over them",
            found.path,
            found.start,
        )


def lock_loop_backing_file(device_fd: int, path: str, type_name: str) -> int:
    """For a loop device: the locks of :func:`_lock_backing` on the file behind it, held
    as long as the descriptor returned stays open (-1: not a loop device, nothing held).

    The device's own lock and exclusive open do not reach that file: an adapter (this
    server's or another's, ``raw_block`` or ``dax``) naming the file itself, or a loop
    device over the same bytes of it, would otherwise take the same bytes for its own
    device and overwrite the slots of the one naming this loop device.  Each takes the
    locks on the file, so the second is refused whichever comes first.
    """
    found = _loop_backing_file(device_fd)
    if found is None:
        return -1
    try:
        fd = _open_backing(found.path)
    except OSError as exc:
        # Not even readable here (or gone from this mount namespace): no adapter of this
        # user can open it read-write as its device either, so none can clash with this one.
        log.warning(
            "%s: %s is a loop device over %s, which cannot be opened to lock it (%s); an adapter "
            "naming that file is not refused",
            type_name,
            path,
            found.path,
            exc.strerror,
        )
        return -1
    try:
        _lock_backing(fd, found)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"{type_name}: {_backing_in_use(path, found.path)}") from None
    except OSError as exc:
        os.close(fd)
        raise ConfigError(
            f"{type_name}: cannot lock {found.path} (behind the loop device {path}) against a second "
            f"server: {exc.strerror}"
        ) from None
    return fd


def probe_loop_backing_file(path: str, field: str, type_name: str) -> None:
    """Pre-flight of :func:`lock_loop_backing_file`: refuse a loop device ``path`` whose
    file (or its bytes) another adapter holds now.  Tried and let go at once (the close
    drops both locks); the open stays the authority."""
    try:
        if not stat.S_ISBLK(os.stat(path).st_mode):
            return
        device_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:  # the open says what it says
        return
    try:
        found = _loop_backing_file(device_fd)
    finally:
        os.close(device_fd)
    if found is None:
        return
    try:
        fd = _open_backing(found.path)
    except OSError:
        return
    try:
        _lock_backing(fd, found)
    except BlockingIOError:
        raise FieldError(field, _backing_in_use(path, found.path)) from None
    except OSError:
        return
    finally:
        os.close(fd)


def _backing_in_use(path: str, backing: str) -> str:
    return (
        f"{path} is a loop device over {backing}, which another adapter (this server or "
        "another one) holds; give each adapter a device of its own"
    )


def remove_created(path: str, created: os.stat_result, type_name: str) -> None:
    """Remove the file a refused start-up created at ``path`` (``created``: its stat), once
    every descriptor of it this adapter opened is closed.

    Left alone when ``path`` names another file now, or when another process holds its
    lock: a second server that opened the new file meanwhile may be using it.  Where
    ``flock`` is not supported no server runs on the file, so it goes.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return  # gone already, or replaced by a symlink: not the file created
    try:
        if not os.path.samestat(os.fstat(fd), created):
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return
        except OSError:
            pass
        os.unlink(path)
        log.info("%s: removed %s, created by this refused start-up", type_name, path)
    except OSError as exc:
        log.warning("%s: cannot remove %s, created by this refused start-up: %s", type_name, path, exc)
    finally:
        os.close(fd)


def _identity(path: str) -> str:
    """What two paths to one device (or file) share: the device number of a device node,
    the inode of a file, the real path of what does not exist yet."""
    try:
        info = os.stat(path)
    except OSError:
        return f"path:{os.path.realpath(path)}"
    if stat.S_ISBLK(info.st_mode) or stat.S_ISCHR(info.st_mode):
        return f"device:{info.st_rdev}"
    return f"inode:{info.st_dev}:{info.st_ino}"


def probe_device(path: str, field: str, type_name: str) -> None:
    """Pre-flight of :func:`lock_device`: refuse ``path`` (with its words) when an earlier
    adapter of the config names the same device, or another process holds its lock now.

    The device is opened read-only and its lock tried and let go at once; nothing is
    written, kept or created (a missing file is free).  Best effort: the open, which takes
    the lock for good, stays the authority.
    """
    check_claimed_once(_identity(path), field, _in_use(path))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:  # missing, or not readable: the open says what it says
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FieldError(field, _in_use(path)) from None
        except OSError:
            return
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


class InFlight:
    """Counts calls using a resource so that closing it waits for them.

    A backend call still running when the adapter gave up waiting (a device that stopped
    answering) must not find its descriptor closed -- the number could already belong
    to another file -- or its mapping gone.  :meth:`drain` reports whether the calls
    finished; the owner releases the resource only then and leaks it otherwise.
    """

    def __init__(self) -> None:
        self._count = 0
        self._closed = False
        self._changed = threading.Condition()

    @contextmanager
    def use(self) -> Iterator[bool]:
        """Yields False once closed: the caller must then not touch the resource."""
        with self._changed:
            if self._closed:
                usable = False
            else:
                usable = True
                self._count += 1
        try:
            yield usable
        finally:
            if usable:
                with self._changed:
                    self._count -= 1
                    self._changed.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Refuse new calls and wait for running ones; True if none is left."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            self._closed = True
            while self._count:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    log.error("%d device calls still running after %.0f s", self._count, timeout_s)
                    return False
                self._changed.wait(remaining)
        return True
