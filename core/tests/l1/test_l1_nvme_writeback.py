"""NVMe L1 in buffered mode: a writeback error never lets L1 serve bytes that did not reach
the disk.

A buffered write lands in the page cache and reaches the file later; when that writeback
fails, the kernel keeps the error for whoever asks (fsync, sync_file_range) and may drop the
pages, after which a read returns what the disk holds.  The filesystem used here is real:
ext4 on a loop device whose backing file lives on a tmpfs too small for it, so writeback
fails with ENOSPC exactly as a failing disk fails it (root, losetup, mkfs.ext4 needed).
"""

from __future__ import annotations

import gc
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager
from lmcache_tiers.l1.nvme import DIRECT_IO_ALIGN, FILE_SUFFIX

MIB = 1 << 20
IMAGE_BYTES = 64 * MIB  # loop_ext4's image: its tmpfs, grown back, holds it whole
# What a write-back may still put on the full tmpfs before it fails: far less than OBJECT.
SLACK_BYTES = 256 * 1024
OBJECT = 4 * MIB


def _run(*command: str) -> str:
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()


def _used_bytes(path: Path) -> int:
    stat = os.statvfs(path)
    return (stat.f_blocks - stat.f_bfree) * stat.f_frsize


@pytest.fixture
def failing_fs_dir(loop_ext4: Callable[..., tuple[Path, Path]]) -> Iterator[Path]:
    """A directory on ext4 whose device runs out of room as soon as data is written back."""
    mnt, back = loop_ext4("-O", "^has_journal")
    # The image's holes stay holes: shrink the tmpfs to what mkfs wrote, plus a little.
    _run("mount", "-o", f"remount,size={_used_bytes(back) + SLACK_BYTES}", str(back))
    yield mnt

    def leaked() -> list[str]:
        return sorted(path.name for path in mnt.iterdir() if path.name.endswith(FILE_SUFFIX))

    if leaked():  # garbage not yet collected, or a leak: a full collection only then
        gc.collect()
    assert not leaked(), f"NVMe L1 files left behind: {leaked()}"


def _key(index: int) -> ObjectKey:
    return ObjectKey("model", 0, index.to_bytes(32, "big"))


def _pattern(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(1, 256, size, dtype=np.uint8).tobytes()


def _store(l1: L1Manager, key: ObjectKey, data: bytes) -> None:
    obj = l1.reserve_write([key], [len(data)])[key]
    l1.write_object(obj, memoryview(data))
    assert l1.finish_write([key]) == [True]


def _store_through(storage: Any, key: ObjectKey, data: bytes, *, to_l2: bool) -> None:
    obj = storage.reserve_write([key], [len(data)])[key]
    storage.write_object(obj, memoryview(data))
    assert storage.commit_write([key], to_l2=to_l2) == [True]


def _stored_then_written_back_in_vain(l1: L1Manager, index: int) -> bytes:
    """Store object ``index`` and have its write-back fail; its bytes as written."""
    data = _pattern(OBJECT, index)
    _store(l1, _key(index), data)
    path = l1.nvme_file_path
    assert path is not None
    _write_back_and_forget(path)
    return data


def _write_back_and_forget(path: str) -> None:
    """What the kernel does on its own in time: write the dirty pages back (here: fail), then
    reclaim the now clean pages.  Through a descriptor of our own, so the L1's own descriptor
    is still to learn about the error."""
    fd = os.open(path, os.O_RDWR)
    try:
        with pytest.raises(OSError):
            os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_an_object_whose_writeback_failed_is_a_miss_not_other_bytes(failing_fs_dir: Path) -> None:
    with L1Manager(16 * MIB, nvme_path=str(failing_fs_dir), direct_io=False) as l1:
        data = _stored_then_written_back_in_vain(l1, 1)
        obj = l1.reserve_read([_key(1)])[_key(1)]
        out = bytearray(OBJECT)
        try:
            l1.read_object(obj, memoryview(out))
        except KeyError:
            pass  # refused: a miss
        else:
            assert bytes(out) == data, "L1 served bytes that never reached its file"
        l1.finish_read([_key(1)])
        # It is gone from L1, so lookups miss rather than hit and fail at every read,
        # and the error and the dropped object are counted.
        assert not l1.contains(_key(1))
        failures = l1.failures()
        assert failures["l1_nvme_writeback_error"] == 1
        assert failures["l1_nvme_writeback_dropped"] == 1


def test_dropped_objects_not_yet_in_l2_are_counted_as_lost_writes(failing_fs_dir: Path) -> None:
    # Of the objects a write-back error takes out, those whose L2 store had not settled
    # held the only copy of an acknowledged write: they get a count of their own.
    with L1Manager(16 * MIB, nvme_path=str(failing_fs_dir), direct_io=False) as l1:
        _store(l1, _key(7), _pattern(DIRECT_IO_ALIGN, 7))  # stored in L2 already
        _store(l1, _key(8), _pattern(DIRECT_IO_ALIGN, 8))
        assert [obj.key for obj in l1.mark_unstored([_key(8)])] == [_key(8)]
        _stored_then_written_back_in_vain(l1, 9)  # not marked: L1-only
        obj = l1.reserve_read([_key(9)])[_key(9)]
        with pytest.raises(KeyError):
            l1.read_object(obj, memoryview(bytearray(OBJECT)))
        l1.finish_read([_key(9)])
        assert not l1.contains(_key(8))
        failures = l1.failures()
        assert failures["l1_nvme_writeback_dropped"] == 3
        assert failures["l1_nvme_writeback_lost_before_l2"] == 1


def test_a_loan_of_an_object_whose_writeback_failed_is_refused(failing_fs_dir: Path) -> None:
    # An L2 store borrows the bytes through lend(): it must not copy them to L2 either.
    with L1Manager(16 * MIB, nvme_path=str(failing_fs_dir), direct_io=False) as l1:
        data = _stored_then_written_back_in_vain(l1, 2)
        obj = l1.reserve_store([_key(2)])[_key(2)]
        try:
            loan = l1.lend(obj)
        except KeyError:
            pass
        else:
            assert bytes(loan.buffer) == data, "L1 lent bytes that never reached its file"
        l1.finish_store([obj])
        assert not l1.contains(_key(2))
        assert l1.stats().used_bytes == 0


def test_objects_written_before_the_error_leave_and_later_ones_stay(failing_fs_dir: Path) -> None:
    with L1Manager(16 * MIB, nvme_path=str(failing_fs_dir), direct_io=False) as l1:
        _store(l1, _key(3), _pattern(OBJECT, 3))
        _stored_then_written_back_in_vain(l1, 4)
        obj = l1.reserve_read([_key(3)])[_key(3)]
        with pytest.raises(KeyError):
            l1.read_object(obj, memoryview(bytearray(OBJECT)))
        l1.finish_read([_key(3)])
        # Which pages failed is unknown: every object written before the error leaves.
        assert not l1.contains(_key(4))
        assert l1.failures()["l1_nvme_writeback_dropped"] == 2
        # One written after it, once the device has room again, is read back, and the
        # error, already counted, is not counted again.
        _run("mount", "-o", f"remount,size={IMAGE_BYTES * 2}", str(failing_fs_dir.parent / "back"))
        third = _pattern(DIRECT_IO_ALIGN, 5)
        _store(l1, _key(5), third)
        obj = l1.reserve_read([_key(5)])[_key(5)]
        out = bytearray(DIRECT_IO_ALIGN)
        l1.read_object(obj, memoryview(out))
        assert bytes(out) == third
        l1.finish_read([_key(5)])
        assert l1.failures()["l1_nvme_writeback_error"] == 1


def test_the_storage_manager_counts_the_error_among_its_failures(failing_fs_dir: Path) -> None:
    # What /status and /metrics (failures_total{reason=...}) report.
    from lmcache_tiers.config import ServerConfig
    from lmcache_tiers.plugins import discover
    from lmcache_tiers.storage import StorageManager

    config = ServerConfig(
        l1_size_gb=16 / 1024, l2_adapters=(), gds_l1_path=str(failing_fs_dir), gds_l1_use_direct_io=False
    )
    with StorageManager(config, discover().registry) as storage:
        data = _pattern(OBJECT, 6)
        obj = storage.reserve_write([_key(6)], [OBJECT])[_key(6)]
        storage.write_object(obj, memoryview(data))
        assert storage.commit_write([_key(6)], to_l2=False) == [True]
        path = storage.l1.nvme_file_path
        assert path is not None
        _write_back_and_forget(path)
        (obj,) = storage.read([_key(6)])
        with pytest.raises(KeyError):
            storage.read_object(obj, memoryview(bytearray(OBJECT)))
        storage.release([_key(6)])
        failures = storage.status()["failures"]
        assert failures["l1_nvme_writeback_error"] == 1
        assert failures["l1_nvme_writeback_refused"] == 1
        assert failures["l1_nvme_writeback_dropped"] == 1


def test_an_in_process_replay_takes_a_refused_read_as_a_short_retrieve(failing_fs_dir: Path) -> None:
    # The replay reads through StorageManager.read_object like a front end does: a refused
    # copy ends the retrieved prefix there (as the native front end's retrieve does), it
    # does not end the whole replay with a traceback.
    from lmcache_tiers.config import ServerConfig
    from lmcache_tiers.plugins import discover
    from lmcache_tiers.replay import inprocess
    from lmcache_tiers.replay.run import ClientState, ReplayOptions
    from lmcache_tiers.replay.trace import TraceRequest
    from lmcache_tiers.storage import StorageManager

    options = ReplayOptions(block_bytes=OBJECT)
    state = ClientState.for_options(options)
    request = TraceRequest(0, 1500, 1, (1, 2))
    scratch = memoryview(bytearray(OBJECT))
    config = ServerConfig(
        l1_size_gb=16 / 1024, l2_adapters=(), gds_l1_path=str(failing_fs_dir), gds_l1_use_direct_io=False
    )
    with StorageManager(config, discover().registry) as storage:
        inprocess._replay_one(storage, request, state, scratch, 30.0)  # stores both blocks
        path = storage.l1.nvme_file_path
        assert path is not None
        _write_back_and_forget(path)
        inprocess._replay_one(storage, request, state, scratch, 30.0)  # hits, the copy refused
        assert storage.l1.stats().read_locks == 0
    totals = state.totals
    assert totals.stored_blocks == 2 and totals.hit_blocks == 2
    assert totals.short_retrieves == 1
    assert totals.retrieved_blocks == 0 and totals.retrieved_bytes == 0
    assert totals.corrupt_blocks == 0


def test_a_write_back_store_refused_one_object_stores_the_others(failing_fs_dir: Path) -> None:
    # One object of a slice L1 can no longer vouch for must not cost the others their L2
    # store: they are acknowledged writes whose bytes reached the file after the error.
    from lmcache_tiers.config import ServerConfig, decode_adapter
    from lmcache_tiers.plugins import load_registry
    from lmcache_tiers.storage import StorageManager

    registry = load_registry()
    mock = decode_adapter(registry, {"type": "mock", "max_size_gb": 0.05}, 0)
    config = ServerConfig(
        l1_size_gb=16 / 1024, l2_adapters=(mock,), gds_l1_path=str(failing_fs_dir), gds_l1_use_direct_io=False
    )
    with StorageManager(config, registry) as storage:
        before, probe, after = _key(7), _key(8), _key(9)
        _store_through(storage, probe, _pattern(DIRECT_IO_ALIGN, 8), to_l2=False)
        reserved = storage.reserve_write([before, after], [OBJECT, OBJECT])
        storage.write_object(reserved[before], memoryview(_pattern(OBJECT, 7)))
        path = storage.l1.nvme_file_path
        assert path is not None
        _write_back_and_forget(path)
        # L1 learns of the error at its next read (the probe's), before ``after`` is written.
        (obj,) = storage.read([probe])
        with pytest.raises(KeyError):
            storage.read_object(obj, memoryview(bytearray(DIRECT_IO_ALIGN)))
        storage.release([probe])
        _run("mount", "-o", f"remount,size={IMAGE_BYTES * 2}", str(failing_fs_dir.parent / "back"))
        storage.write_object(reserved[after], memoryview(_pattern(OBJECT, 9)))
        assert storage.commit_write([before, after]) == [True, True]
        assert storage.flush(timeout=60)
        status = storage.status()
        (adapter,) = status["adapters"]
        assert (adapter["keys_stored"], adapter["keys_store_failed"]) == (1, 0)
        assert adapter["used_bytes"] == OBJECT  # ``after``, the one written since the error
        assert status["store"]["skipped_gone"] == 1  # ``before``: left L1, counted there
        assert status["failures"]["l1_nvme_writeback_dropped"] == 2
