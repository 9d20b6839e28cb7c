"""NVMe L1 on a disk that answers EIO: an object whose bytes cannot be read is a miss and
leaves L1, and closing the L1 still lets go of its file.

The disk is real: ext4 on a loop device, shut down with ``EXT4_IOC_SHUTDOWN`` (what ext4
does to itself on a fatal device error), after which every read and unlink of the
filesystem fails with EIO (root, losetup, mkfs.ext4 needed).
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager
from lmcache_tiers.l1.nvme import DIRECT_IO_ALIGN

MIB = 1 << 20
#: _IOR('X', 125, __u32): take the filesystem down; flag 2 = without flushing the journal
EXT4_IOC_SHUTDOWN = 0x8004587D
EXT4_GOING_FLAGS_NOLOGFLUSH = 2


@pytest.fixture
def ext4_dir(loop_ext4: Callable[..., tuple[Path, Path]]) -> Path:
    """A directory on its own ext4 filesystem, which the test may shut down."""
    mnt, _ = loop_ext4()
    return mnt


def _shut_down(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, struct.pack("I", EXT4_GOING_FLAGS_NOLOGFLUSH))
    finally:
        os.close(fd)


def _key(index: int) -> ObjectKey:
    return ObjectKey("model", 0, index.to_bytes(32, "big"))


def _store(l1: L1Manager, key: ObjectKey, size: int) -> None:
    obj = l1.reserve_write([key], [size])[key]
    l1.write_object(obj, memoryview(bytes(range(256)) * (size // 256)))
    assert l1.finish_write([key]) == [True]


def test_an_object_the_disk_cannot_read_is_a_miss_and_leaves_l1(
    ext4_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="lmcache_tiers")
    l1 = L1Manager(16 * MIB, nvme_path=str(ext4_dir))
    try:
        _store(l1, _key(1), DIRECT_IO_ALIGN)
        _store(l1, _key(2), DIRECT_IO_ALIGN)
        assert l1.mark_unstored([_key(2)])
        _shut_down(ext4_dir)
        obj = l1.reserve_read([_key(1)])[_key(1)]
        with pytest.raises(KeyError):
            l1.read_object(obj, memoryview(bytearray(DIRECT_IO_ALIGN)))
        l1.finish_read([_key(1)])
        # Every later lookup would hit an object whose every read fails: it is gone instead.
        assert not l1.contains(_key(1))
        # An L2 store borrowing the bytes is refused the same way (a KeyError, not EIO).
        stored = l1.reserve_store([_key(2)])[_key(2)]
        with pytest.raises(KeyError):
            l1.lend(stored)
        l1.finish_store([stored])
        assert not l1.contains(_key(2))
        failures = l1.failures()
        assert failures["l1_nvme_read_error"] == 2
        assert failures["l1_nvme_read_error_lost_before_l2"] == 1
        levels = {record.getMessage().rsplit("; ", 1)[-1]: record.levelno for record in caplog.records}
        assert levels["dropped from L1"] == logging.WARNING
        assert levels["dropped before its L2 store: an acknowledged write lost"] == logging.ERROR
    finally:
        l1.close()


def test_closing_on_a_disk_that_refuses_the_unlink_does_not_raise(ext4_dir: Path) -> None:
    l1 = L1Manager(16 * MIB, nvme_path=str(ext4_dir))
    _store(l1, _key(1), DIRECT_IO_ALIGN)
    _shut_down(ext4_dir)
    l1.close()  # the file cannot be removed (EIO): said in a log line, start-up reaps it
    l1.close()


def test_a_write_the_disk_refuses_is_counted(ext4_dir: Path) -> None:
    """The writer is told (OSError: its store or load fails, nothing is committed), and the
    refusal is counted: a failing disk shows in /metrics, not only as internal errors."""
    l1 = L1Manager(16 * MIB, nvme_path=str(ext4_dir))
    try:
        _shut_down(ext4_dir)
        obj = l1.reserve_write([_key(1)], [DIRECT_IO_ALIGN])[_key(1)]
        with pytest.raises(OSError):
            l1.write_object(obj, memoryview(bytearray(DIRECT_IO_ALIGN)))
        l1.abort_write([_key(1)])
        assert not l1.contains(_key(1))
        assert l1.failures()["l1_nvme_write_error"] == 1
    finally:
        l1.close()


def test_a_read_locked_object_dropped_for_a_read_error_is_not_a_forced_delete(
    ext4_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its extent is held for its readers as after a forced delete, but counted as dropped:
    ``forced`` says a client cleared objects, and the drop has its own (throttled) log line."""
    l1 = L1Manager(16 * MIB, nvme_path=str(ext4_dir))
    try:
        _store(l1, _key(1), DIRECT_IO_ALIGN)
        _shut_down(ext4_dir)
        obj = l1.reserve_read([_key(1)])[_key(1)]
        with pytest.raises(KeyError):
            l1.read_object(obj, memoryview(bytearray(DIRECT_IO_ALIGN)))
        held = l1.lease_stats()
        assert (held.quarantined_extents, held.quarantined_dropped, held.quarantined_forced) == (1, 1, 0)
        assert "deleted by force" not in caplog.text
        l1.finish_read([_key(1)])
        assert l1.lease_stats().reclaimed_released == 1
    finally:
        l1.close()


def test_an_object_past_the_end_of_a_truncated_file_is_a_miss_and_leaves_l1(nvme_dir: Path) -> None:
    # The block file cut short under the server (an operator's truncate, a filesystem
    # repair): a read of it ends early.  That is a read error like EIO -- a miss, the
    # object dropped and counted -- not an exception that leaves the object in L1 for every
    # lookup to hit and every read to fail on.
    l1 = L1Manager(16 * MIB, nvme_path=str(nvme_dir))
    try:
        _store(l1, _key(1), DIRECT_IO_ALIGN)
        path = l1.nvme_file_path
        assert path is not None
        os.truncate(path, 0)
        obj = l1.reserve_read([_key(1)])[_key(1)]
        with pytest.raises(KeyError):
            l1.read_object(obj, memoryview(bytearray(DIRECT_IO_ALIGN)))
        l1.finish_read([_key(1)])
        assert not l1.contains(_key(1))
        assert l1.failures()["l1_nvme_read_error"] == 1
    finally:
        l1.close()
