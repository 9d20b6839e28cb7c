"""NVMe L1: objects in blocks of one O_DIRECT file; copies in and out for both backings."""

from __future__ import annotations

import ctypes.util
import errno
import fcntl
import gc
import logging
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lmcache_tiers.errors import ConfigError, TiersError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager, NvmeL1File, aligned_buffer, remove_stale_block_files
from lmcache_tiers.l1.nvme import BOUNCE_BYTES, DIRECT_IO_ALIGN, FILE_PREFIX, FILE_SUFFIX

ALIGN = DIRECT_IO_ALIGN
MIB = 1 << 20
# Sizes around block and bounce-buffer boundaries, where rounding and chunking can go wrong.
ODD_SIZES = [0, 1, 511, ALIGN - 1, ALIGN, ALIGN + 1, 3 * ALIGN + 17, BOUNCE_BYTES + ALIGN + 5]
CAPACITY = 2 * BOUNCE_BYTES + 16 * ALIGN


def pattern(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def unaligned(data: bytes) -> memoryview:
    """A writable copy of ``data`` that starts one byte past a page boundary."""
    backing = aligned_buffer(len(data) + 1)
    backing[1:] = data
    return backing[1:]


def block_files(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"{FILE_PREFIX}*{FILE_SUFFIX}"))


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def blocks(request: pytest.FixtureRequest, nvme_dir: Path) -> Iterator[NvmeL1File]:
    file = NvmeL1File(str(nvme_dir), CAPACITY, direct_io=request.param)
    yield file
    file.close()


# -- the block file ------------------------------------------------------------------------


@pytest.mark.parametrize("size", ODD_SIZES)
def test_round_trip_through_aligned_and_unaligned_buffers(blocks: NvmeL1File, size: int) -> None:
    offset = 3 * ALIGN
    data = pattern(size, size)
    for source in (memoryview(data), unaligned(data)):  # read-only bytes, then an odd address
        blocks.write_from(offset, source)
        for out in (aligned_buffer(size), unaligned(bytes(size)), memoryview(bytearray(size))):
            blocks.read_into(offset, size, out)
            assert bytes(out) == data
        with open(blocks.path, "rb") as raw:  # really at that offset in the file
            raw.seek(offset)
            assert raw.read(size) == data


def test_writes_stay_inside_their_blocks(blocks: NvmeL1File) -> None:
    first, second = pattern(ALIGN + 1, 1), pattern(2 * ALIGN, 2)
    blocks.write_from(2 * ALIGN, memoryview(second))
    blocks.write_from(0, memoryview(first))  # rounded up to 2 blocks: ends where `second` starts
    out = bytearray(2 * ALIGN)
    blocks.read_into(2 * ALIGN, 2 * ALIGN, memoryview(out))
    assert out == second
    blocks.read_into(0, ALIGN + 1, memoryview(out))
    assert out[: ALIGN + 1] == first


def test_a_larger_output_buffer_gets_only_the_object(blocks: NvmeL1File) -> None:
    blocks.write_from(0, memoryview(b"abc"))
    out = bytearray(b"z" * 10)
    blocks.read_into(0, 3, memoryview(out))
    assert out == b"abczzzzzzz"


def test_bad_transfers_are_refused(blocks: NvmeL1File) -> None:
    with pytest.raises(ValueError, match="not a multiple"):
        blocks.write_from(100, memoryview(b"x"))
    with pytest.raises(ValueError, match="do not fit"):
        blocks.write_from(CAPACITY - ALIGN, memoryview(bytes(ALIGN + 1)))
    with pytest.raises(ValueError, match="cannot hold"):
        blocks.read_into(0, 10, memoryview(bytearray(5)))
    with pytest.raises(ValueError, match="read-only"):
        blocks.read_into(0, 5, memoryview(bytes(5)))


def test_a_write_the_file_does_not_take_is_an_error_not_a_hang(
    blocks: NvmeL1File, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: 0)
    errors: list[BaseException] = []

    def write() -> None:
        try:
            blocks.write_from(0, memoryview(pattern(ALIGN, 1)))
        except BaseException as exc:  # surfaced by the assertions below
            errors.append(exc)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    writer.join(10.0)
    hung = writer.is_alive()
    monkeypatch.undo()  # lets a hung writer finish, and close() with it
    writer.join()
    assert not hung, "a write that makes no progress retried forever"
    assert len(errors) == 1 and isinstance(errors[0], OSError) and errors[0].errno == errno.EIO


def test_a_write_the_file_does_not_take_fails_its_writer_and_is_counted(
    nvme_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An OSError like any failed write: the L1 counts and logs it (a TiersError went by
    # uncounted, a failing disk showing only as its callers' errors).
    with L1Manager(4 * ALIGN, align=ALIGN, nvme_path=str(nvme_dir)) as l1:
        obj = l1.reserve_write([ObjectKey("m", 0, b"k")], [ALIGN])[ObjectKey("m", 0, b"k")]
        monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: 0)
        with pytest.raises(OSError):
            l1.write_object(obj, memoryview(pattern(ALIGN, 1)))
        monkeypatch.undo()
        assert l1.failures()["l1_nvme_write_error"] == 1
        l1.abort_write([obj.key])


def test_file_is_preallocated_and_removed_on_close(nvme_dir: Path) -> None:
    file = NvmeL1File(str(nvme_dir), CAPACITY)
    assert block_files(nvme_dir) == [Path(file.path)]
    assert Path(file.path).name.startswith(f"{FILE_PREFIX}{os.getpid()}_")
    stat = os.stat(file.path)
    assert stat.st_size == CAPACITY and stat.st_blocks * 512 >= CAPACITY
    file.close()
    file.close()
    assert block_files(nvme_dir) == []
    with pytest.raises(RuntimeError, match="closed"):
        file.read_into(0, 1, memoryview(bytearray(1)))


def test_garbage_collection_removes_a_forgotten_file(nvme_dir: Path) -> None:
    file = NvmeL1File(str(nvme_dir), ALIGN)
    path = Path(file.path)
    del file
    gc.collect()
    assert not path.exists()


def test_forked_child_exiting_does_not_remove_the_parents_file(nvme_dir: Path) -> None:
    # In a fresh interpreter, so the child's normal exit (atexit, finalizers) runs for real.
    script = textwrap.dedent(
        f"""
        import os, sys
        from lmcache_tiers.l1 import NvmeL1File
        file = NvmeL1File({str(nvme_dir)!r}, 4096)
        pid = os.fork()
        if pid == 0:
            sys.exit(0)
        os.waitpid(pid, 0)
        print(os.path.exists(file.path), flush=True)
        file.close()
        print(os.path.exists(file.path), flush=True)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False"]


def test_stale_files_of_dead_processes_are_removed_at_start_up(
    nvme_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    stale = nvme_dir / f"{FILE_PREFIX}{int(dead.stdout)}_deadbeef{FILE_SUFFIX}"
    alive = nvme_dir / f"{FILE_PREFIX}{os.getppid()}_0123abcd{FILE_SUFFIX}"
    custom = nvme_dir / f"{FILE_PREFIX}custom{FILE_SUFFIX}"
    for path in (stale, alive, custom):
        path.write_bytes(b"x")
    try:
        with caplog.at_level(logging.WARNING), NvmeL1File(str(nvme_dir), ALIGN) as file:
            assert not stale.exists()
            assert f"removed stale NVMe L1 file {nvme_dir}/{stale.name}" in caplog.text
            assert alive.exists() and custom.exists()  # live owners and custom names are left alone
            assert remove_stale_block_files(str(nvme_dir)) == []  # nor is the file of this process
            assert Path(file.path).exists()
    finally:
        alive.unlink()
        custom.unlink()


def test_a_live_file_whose_pid_is_not_visible_here_is_left_alone(nvme_dir: Path) -> None:
    # A server in another pid namespace sharing the directory: its pid means nothing here,
    # the lock its file holds does (the file under a dead pid's name: a hard link).
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    with NvmeL1File(str(nvme_dir), ALIGN) as file:
        other = nvme_dir / f"{FILE_PREFIX}{int(dead.stdout)}_deadbeef{FILE_SUFFIX}"
        os.link(file.path, other)
        assert remove_stale_block_files(str(nvme_dir)) == []
        assert other.exists()
        other.unlink()
    assert block_files(nvme_dir) == []


def test_leftover_block_files_removed_or_kept_at_start_up_are_counted(nvme_dir: Path) -> None:
    # Each leftover holds up to a whole L1 of disk: a log line alone left nothing in
    # /metrics to show that space taken (kept) or that a server had been killed (removed).
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    removed = nvme_dir / f"{FILE_PREFIX}{int(dead.stdout)}_deadbeef{FILE_SUFFIX}"
    kept = nvme_dir / f"{FILE_PREFIX}{int(dead.stdout)}_0badcafe{FILE_SUFFIX}"
    for path in (removed, kept):
        path.write_bytes(b"x")
    # The creator's lock held: a live server in another pid namespace, as far as can be told.
    holder = os.open(kept, os.O_RDONLY)
    try:
        fcntl.flock(holder, fcntl.LOCK_SH)
        manager = L1Manager(4 * ALIGN, align=ALIGN, nvme_path=str(nvme_dir))
        try:
            failures = manager.failures()
            assert failures["l1_nvme_stale_files_removed"] == 1
            assert failures["l1_nvme_stale_files_kept"] == 1
            assert not removed.exists() and kept.exists()
        finally:
            manager.close()
    finally:
        os.close(holder)
        kept.unlink()
    with L1Manager(4 * ALIGN, align=ALIGN, nvme_path=str(nvme_dir)) as manager:
        assert not {"l1_nvme_stale_files_removed", "l1_nvme_stale_files_kept"} & set(manager.failures())


def test_a_killed_predecessor_with_this_process_pid_has_its_file_removed(nvme_dir: Path) -> None:
    # A server restarted in a fresh container often gets the pid its killed predecessor
    # had: the file under that name holds a whole L1 of disk, and no lock.
    stale = nvme_dir / f"{FILE_PREFIX}{os.getpid()}_deadbeef{FILE_SUFFIX}"
    stale.write_bytes(b"x")
    try:
        with NvmeL1File(str(nvme_dir), ALIGN) as first:
            assert not stale.exists()
            with NvmeL1File(str(nvme_dir), ALIGN) as second:  # this process's live file stays
                assert Path(first.path).exists() and Path(second.path).exists()
    finally:
        stale.unlink(missing_ok=True)


def test_a_block_file_name_with_an_impossible_pid_does_not_stop_start_up(nvme_dir: Path) -> None:
    huge = nvme_dir / f"{FILE_PREFIX}{10**12}_deadbeef{FILE_SUFFIX}"  # overflows kill(2)'s pid_t
    huge.write_bytes(b"x")
    try:
        with NvmeL1File(str(nvme_dir), ALIGN) as file:
            assert Path(file.path).exists()
        assert huge.exists()  # not a name this code creates: left alone
    finally:
        huge.unlink()


def test_a_filesystem_without_o_direct_is_a_clear_error(
    nvme_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def no_direct_open(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & os.O_DIRECT:
            os.close(real_open(path, flags & ~os.O_DIRECT, mode))  # Linux creates it, then refuses
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", no_direct_open)
    with pytest.raises(ConfigError, match=r"does not support O_DIRECT.*--no-gds-l1-use-direct-io"):
        NvmeL1File(str(nvme_dir), ALIGN)
    assert block_files(nvme_dir) == []
    with NvmeL1File(str(nvme_dir), ALIGN, direct_io=False) as file:  # buffered I/O still works
        file.write_from(0, memoryview(b"buffered"))
        out = bytearray(8)
        file.read_into(0, 8, memoryview(out))
        assert out == b"buffered"


def test_o_direct_refused_on_first_transfer_fails_at_start_up(
    nvme_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(fd: int, data: Any, offset: int) -> int:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "pwrite", refuse)
    with pytest.raises(ConfigError, match="does not support O_DIRECT"):
        NvmeL1File(str(nvme_dir), ALIGN)
    assert block_files(nvme_dir) == []


def test_a_full_disk_is_a_clear_error_and_leaves_no_file(
    nvme_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(TiersError, match="lower --l1-size-gb"):
        NvmeL1File(str(nvme_dir), ALIGN)
    assert block_files(nvme_dir) == []


def test_a_missing_directory_and_bad_sizes_are_config_errors(nvme_dir: Path) -> None:
    with pytest.raises(ConfigError, match="not an existing directory"):
        NvmeL1File(str(nvme_dir / "missing"), ALIGN)
    for size in (0, ALIGN + 1):
        with pytest.raises(ConfigError, match="positive multiple"):
            NvmeL1File(str(nvme_dir), size)


@pytest.mark.parametrize("direct_io", [True, False])
def test_start_up_says_which_io_path_is_used(
    nvme_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, direct_io: bool
) -> None:
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    mode = "O_DIRECT" if direct_io else "buffered"
    with (
        caplog.at_level(logging.INFO, logger="lmcache_tiers.l1.nvme"),
        NvmeL1File(str(nvme_dir), ALIGN, direct_io=direct_io) as file,
    ):
        expected = f"NVMe L1: cuFile not available, using {mode} file I/O on {file.path}"
    assert expected in caplog.messages


def test_a_present_cufile_is_reported(
    nvme_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    asked: list[str] = []
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: asked.append(name) or "libcufile.so.0")
    with (
        caplog.at_level(logging.INFO, logger="lmcache_tiers.l1.nvme"),
        NvmeL1File(str(nvme_dir), ALIGN) as file,
    ):
        pass
    assert asked == ["cufile"]
    assert any(
        "cuFile found (libcufile.so.0)" in message and f"O_DIRECT file I/O on {file.path}" in message
        for message in caplog.messages
    )


def test_concurrent_transfers_and_close(nvme_dir: Path) -> None:
    file = NvmeL1File(str(nvme_dir), 64 * ALIGN)
    errors: list[BaseException] = []

    def worker(slot: int) -> None:
        try:
            for round_ in range(20):
                data = pattern(ALIGN + slot * 100 + round_, slot * 1000 + round_)
                file.write_from(slot * 2 * ALIGN, unaligned(data))
                out = bytearray(len(data))
                file.read_into(slot * 2 * ALIGN, len(data), memoryview(out))
                assert out == data
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(slot,)) for slot in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    file.close()
    assert block_files(nvme_dir) == []


def test_aligned_buffer_is_page_aligned_and_zeroed() -> None:
    for size in (0, 1, ALIGN + 3):
        buffer = aligned_buffer(size)
        assert buffer.nbytes == size and not buffer.readonly
        assert bytes(buffer) == bytes(size)
        assert np.frombuffer(aligned_buffer(size + 1), np.uint8).ctypes.data % ALIGN == 0


# -- the manager on either backing ---------------------------------------------------------


def key(index: int) -> ObjectKey:
    return ObjectKey("test-model", 0, index.to_bytes(8, "big"))


@pytest.fixture(params=["memory", "nvme"])
def manager(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[L1Manager]:
    if request.param == "memory":
        l1 = L1Manager(CAPACITY, prefault=False)
    else:
        l1 = L1Manager(CAPACITY, nvme_path=str(request.getfixturevalue("nvme_dir")))
    yield l1
    l1.close()


def test_objects_round_trip_through_read_and_write_object(manager: L1Manager) -> None:
    sizes = [1, ALIGN - 1, ALIGN + 1, 5 * ALIGN + 3, 0]
    reserved = manager.reserve_write([key(i) for i in range(len(sizes))], sizes)
    contents = {k: pattern(obj.size, i) for i, (k, obj) in enumerate(reserved.items())}
    for k, obj in reserved.items():
        manager.write_object(obj, unaligned(contents[k]) if obj.size % 2 else memoryview(contents[k]))
    assert all(manager.finish_write(list(reserved)))
    hits = manager.reserve_read(list(reserved))
    for k, obj in hits.items():
        out = bytearray(obj.size + 3)
        manager.read_object(obj, memoryview(out))
        assert out[: obj.size] == contents[k] and out[obj.size :] == bytes(3)
    manager.finish_read(list(hits))


def test_multi_dimensional_buffers_are_copied_as_bytes(manager: L1Manager) -> None:
    array = np.arange(6 * 100, dtype=np.float32).reshape(6, 100)
    obj = manager.reserve_write([key(1)], [array.nbytes])[key(1)]
    manager.write_object(obj, memoryview(array))
    manager.finish_write([key(1)])
    out = np.zeros_like(array)
    manager.read_object(obj, memoryview(out))
    assert np.array_equal(out, array)


def test_copies_check_size_state_and_presence(manager: L1Manager) -> None:
    obj = manager.reserve_write([key(1)], [100])[key(1)]
    with pytest.raises(ValueError, match="holds 100 bytes, got 99"):
        manager.write_object(obj, memoryview(bytes(99)))
    manager.write_object(obj, memoryview(bytes(100)))
    manager.finish_write([key(1)])
    with pytest.raises(ValueError, match="ready, not being written"):
        manager.write_object(obj, memoryview(bytes(100)))  # readers rely on committed bytes
    with pytest.raises(ValueError, match="cannot hold"):
        manager.read_object(obj, memoryview(bytearray(99)))
    manager.delete([key(1)])
    with pytest.raises(KeyError):
        manager.read_object(obj, memoryview(bytearray(100)))
    with pytest.raises(KeyError):
        manager.write_object(obj, memoryview(bytes(100)))


def test_backing_is_reported(manager: L1Manager) -> None:
    obj = manager.reserve_write([key(1)], [10])[key(1)]
    if manager.is_memory:
        assert manager.nvme_file_path is None
        assert manager.view(obj).nbytes == 10 and manager.arena.size == CAPACITY
        return
    assert manager.nvme_file_path is not None and os.path.exists(manager.nvme_file_path)
    with pytest.raises(TiersError, match="no memory view: copy them with read_object/write_object"):
        manager.view(obj)
    with pytest.raises(TiersError, match="not in a memory arena"):
        manager.arena  # noqa: B018


def test_nvme_manager_removes_its_file_on_close(nvme_dir: Path) -> None:
    l1 = L1Manager(16 * ALIGN, nvme_path=str(nvme_dir), direct_io=True)
    assert [str(path) for path in block_files(nvme_dir)] == [l1.nvme_file_path]
    l1.close()
    l1.close()
    assert block_files(nvme_dir) == []


def test_nvme_manager_needs_block_aligned_extents(nvme_dir: Path) -> None:
    with pytest.raises(ConfigError, match="multiple of 4096"):
        L1Manager(16 * ALIGN, align=512, nvme_path=str(nvme_dir))
    assert block_files(nvme_dir) == []


@pytest.mark.parametrize("refusal", [errno.ENOSYS, errno.EPERM])
def test_a_system_refusing_the_write_back_question_is_asked_with_fdatasync(
    blocks: NvmeL1File, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, refusal: int
) -> None:
    """A seccomp filter may refuse sync_file_range itself: that is no write-back error (taken
    for one, every read would drop all of L1); fdatasync, which reports the same errors, is
    asked instead, from then on."""
    import lmcache_tiers.l1.nvme as nvme

    calls: list[int] = []

    def refused(*args: Any) -> int:
        calls.append(1)
        ctypes.set_errno(refusal)
        return -1

    synced: list[int] = []
    real_fdatasync = os.fdatasync
    monkeypatch.setattr(nvme, "_sync_file_range", refused)
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real_fdatasync(fd))[1])
    blocks.write_from(0, memoryview(pattern(ALIGN, 2)))
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers.l1.nvme"):
        assert blocks.writeback_errors() == 0
        assert blocks.writeback_errors() == 0
    assert calls == [1], "the refused call was asked again"
    assert len(synced) == 2
    assert sum("sync_file_range is refused" in record.getMessage() for record in caplog.records) == 1
    assert not any(record.levelno >= logging.ERROR for record in caplog.records)


def test_the_fdatasync_question_is_never_asked_of_a_closed_file(
    blocks: NvmeL1File, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asked with fdatasync, the write-back question runs as a transfer does: after close
    its descriptor may be closed or another file's, and an EBADF taken for a write-back
    error would drop every object written before it."""
    import lmcache_tiers.l1.nvme as nvme

    def refused(*args: Any) -> int:
        ctypes.set_errno(errno.ENOSYS)
        return -1

    monkeypatch.setattr(nvme, "_sync_file_range", refused)
    assert blocks.writeback_errors() == 0  # refused once: fdatasync from now on
    blocks.close()
    with pytest.raises(RuntimeError, match="closed"):
        blocks.writeback_errors()
    assert blocks.writeback_errors_seen == 0


def test_a_refused_write_back_question_is_counted_among_l1_failures(
    nvme_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fall back to fdatasync (sync_file_range refused by the system) writes back every
    dirty page on each read's question: counted once (``l1_nvme_sync_file_range_refused``),
    as it is logged once, so /metrics shows why buffered L1 reads cost a sync."""
    import lmcache_tiers.l1.nvme as nvme

    def refused(*args: Any) -> int:
        ctypes.set_errno(errno.ENOSYS)
        return -1

    monkeypatch.setattr(nvme, "_sync_file_range", refused)
    l1 = L1Manager(CAPACITY, nvme_path=str(nvme_dir), direct_io=False)
    try:
        obj = l1.reserve_write([key(1)], [ALIGN])[key(1)]
        l1.write_object(obj, memoryview(pattern(ALIGN, 4)))
        assert l1.finish_write([key(1)]) == [True]
        for _ in range(2):
            hits = l1.reserve_read([key(1)])
            out = bytearray(ALIGN)
            l1.read_object(hits[key(1)], memoryview(out))
            l1.finish_read([key(1)])
            assert out == pattern(ALIGN, 4)
        assert l1.failures() == {"l1_nvme_sync_file_range_refused": 1}
    finally:
        l1.close()
