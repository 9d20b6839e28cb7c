"""The client's mapping is populated ahead of its copies, and copies stay exact either way."""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from lmcache_tiers.wire import pagetables
from lmcache_tiers.wire.pagetables import COPY_PIECE, PageTables

SIZE = 24 << 20


@pytest.fixture
def mapping() -> Iterator[np.ndarray[Any, Any]]:
    """A fresh shared mapping of a tmpfs file (unmapped when the last view goes)."""
    path = f"/dev/shm/lmcache-tiers-test-pages-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, SIZE)
        yield np.frombuffer(mmap.mmap(fd, SIZE), dtype=np.uint8)
    finally:
        os.close(fd)
        os.unlink(path)


def resident_kib(address: int) -> int:
    """Rss of the mapping starting at ``address``: pages mapped into this process."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                inside = int(fields[0].split("-")[0], 16) == address
            elif inside and fields[0] == "Rss:":
                return int(fields[1])
    raise AssertionError("mapping not found in /proc/self/smaps")


def test_the_background_pass_maps_every_page(
    mapping: np.ndarray[Any, Any], new_threads: Callable[[str], list[threading.Thread]]
) -> None:
    array = mapping
    address = array.ctypes.data
    if pagetables._madvise is None:
        pytest.skip("no madvise through ctypes on this platform")
    assert resident_kib(address) == 0
    pages = PageTables(address, SIZE)
    pages.start()
    assert pages.wait(30)
    if resident_kib(address) == 0:
        pytest.skip("this kernel has no MADV_POPULATE_READ (Linux < 5.14)")
    assert resident_kib(address) == SIZE // 1024
    pages.stop()
    assert new_threads("shm-populate") == []


def test_start_has_the_copy_helper_waiting_and_stop_ends_it(
    mapping: np.ndarray[Any, Any], new_threads: Callable[[str], list[threading.Thread]]
) -> None:
    # A fresh client's first large copy finds the helper already running (started at
    # connect) instead of creating a thread in the middle of its store.
    pages = PageTables(mapping.ctypes.data, SIZE)
    assert new_threads("shm-copy") == []
    pages.start()
    assert len(new_threads("shm-copy")) == 1
    source = np.random.default_rng(11).integers(0, 256, 8 * COPY_PIECE, dtype=np.uint8)
    pages.write(mapping[COPY_PIECE : 9 * COPY_PIECE], source, COPY_PIECE)
    assert np.array_equal(mapping[COPY_PIECE : 9 * COPY_PIECE], source)
    assert len(new_threads("shm-copy")) == 1
    pages.stop()
    assert new_threads("shm-copy") == [] and new_threads("shm-populate") == []


@pytest.mark.parametrize(("offset", "size"), [(0, COPY_PIECE), (4095, 3 * COPY_PIECE + 17), (12345, 100)])
def test_writes_are_exact_and_populate_their_range(
    mapping: np.ndarray[Any, Any],
    offset: int,
    size: int,
    new_threads: Callable[[str], list[threading.Thread]],
) -> None:
    array = mapping
    pages = PageTables(array.ctypes.data, SIZE)  # no background pass: every write populates
    source = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    pages.write(array[offset : offset + size], source, offset)
    if pagetables._madvise is not None and size >= COPY_PIECE:
        # the write's range was populated, and nothing far outside it
        assert 2 * size // 1024 > resident_kib(array.ctypes.data) >= size // 1024
    assert np.array_equal(array[offset : offset + size], source)
    assert not array[:offset].any() and not array[offset + size :].any()
    pages.stop()
    assert new_threads("shm-populate") == []


def test_a_kernel_without_populate_still_copies_and_says_so_once(
    mapping: np.ndarray[Any, Any],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[int] = []

    def old_kernel(address: int, length: int, advice: int) -> int:
        calls.append(length)
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(pagetables, "_madvise", old_kernel)
    array = mapping
    caplog.set_level(logging.INFO, logger=pagetables.__name__)
    pages = PageTables(array.ctypes.data, SIZE)
    pages.start()
    assert pages.wait(30)  # gave up: nothing more will be populated
    assert pages.complete
    for offset in (0, 5 * COPY_PIECE + 1):
        source = np.full(3 * COPY_PIECE, offset % 251 + 1, dtype=np.uint8)
        pages.write(array[offset : offset + source.nbytes], source, offset)
        assert np.array_equal(array[offset : offset + source.nbytes], source)
    assert len(calls) == 1  # tried once, then the copies fault pages in as before
    lines = [record.getMessage() for record in caplog.records if "not populating" in record.getMessage()]
    assert len(lines) == 1 and "older than 5.14" in lines[0]
    pages.stop()


def test_stop_ends_the_background_pass_and_writes_go_on(
    mapping: np.ndarray[Any, Any], new_threads: Callable[[str], list[threading.Thread]]
) -> None:
    array = mapping
    pages = PageTables(array.ctypes.data, SIZE)
    pages.start()
    source = np.ones(4 * COPY_PIECE, dtype=np.uint8)
    pages.write(array[: source.nbytes], source, 0)
    pages.stop()
    assert new_threads("shm-populate") == []
    # after stop a write copies without populating
    pages.write(array[SIZE - source.nbytes :], source, SIZE - source.nbytes)
    assert array[SIZE - source.nbytes :].all()
    assert new_threads("shm-populate") == []


def test_the_background_pass_waits_while_the_client_is_busy(mapping: np.ndarray[Any, Any]) -> None:
    if pagetables._madvise is None:
        pytest.skip("no madvise through ctypes on this platform")
    array = mapping
    pages = PageTables(array.ctypes.data, SIZE)
    with pages.in_use():
        pages.start()
        assert not pages.wait(3 * pagetables.IDLE_S)  # paused for as long as the block runs
    assert pages.wait(30)
    pages.stop()


def addresses_populated(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The address of each block populated from now on (none without madvise)."""
    real = pagetables._madvise
    calls: list[int] = []
    if real is not None:

        def counting(address: int, length: int, advice: int) -> int:
            calls.append(address)
            return int(real(address, length, advice))

        monkeypatch.setattr(pagetables, "_madvise", counting)
    return calls


def test_each_block_is_populated_once(mapping: np.ndarray[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    if pagetables._madvise is None:
        pytest.skip("no madvise through ctypes on this platform")
    calls = addresses_populated(monkeypatch)
    array = mapping
    pages = PageTables(array.ctypes.data, SIZE)
    source = np.full(2 * COPY_PIECE + 10, 7, dtype=np.uint8)
    offset = COPY_PIECE // 2
    pages.write(array[offset : offset + source.nbytes], source, offset)
    assert len(calls) == 3  # the three blocks the write touches
    pages.write(array[offset : offset + source.nbytes], source, offset)
    assert len(calls) == 3  # already populated: copied straight away
    assert np.array_equal(array[offset : offset + source.nbytes], source)
    pages.stop()


def test_many_small_copies_are_exact_and_populate_each_block_once(
    mapping: np.ndarray[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Chunks smaller than a block, some straddling a block boundary, one filling a block
    # exactly, in one request: large enough in all to be split between two threads.
    real = pagetables._madvise
    calls = addresses_populated(monkeypatch)
    array = mapping
    pages = PageTables(array.ctypes.data, SIZE)
    rng = np.random.default_rng(5)
    size = 3 * COPY_PIECE // 16
    layout = [(index * size, size) for index in range(32)] + [(7 * COPY_PIECE, COPY_PIECE)]
    sources = [rng.integers(0, 256, length, dtype=np.uint8) for _, length in layout]
    pages.write_many(
        [
            (array[offset : offset + length], source, offset)
            for (offset, length), source in zip(layout, sources, strict=True)
        ]
    )
    for (offset, length), source in zip(layout, sources, strict=True):
        assert np.array_equal(array[offset : offset + length], source)
    assert not array[6 * COPY_PIECE : 7 * COPY_PIECE].any() and not array[8 * COPY_PIECE :].any()
    if real is not None:
        # (two threads copying chunks that share a block may both populate it: harmless)
        blocks = {(address - array.ctypes.data) // COPY_PIECE for address in calls}
        assert blocks == {0, 1, 2, 3, 4, 5, 7}
    pages.stop()


def test_a_write_into_a_range_of_another_size_raises(mapping: np.ndarray[Any, Any]) -> None:
    array = mapping
    pages = PageTables(array.ctypes.data, SIZE)
    with pytest.raises(ValueError, match="cannot copy"):
        pages.write(array[:0], np.ones(3 * COPY_PIECE, dtype=np.uint8), 0)
    pages.stop()


def test_several_copies_at_once_are_exact_both_ways(
    mapping: np.ndarray[Any, Any], new_threads: Callable[[str], list[threading.Thread]]
) -> None:
    array = mapping
    pages = PageTables(array.ctypes.data, SIZE)  # no background pass: the copies populate
    rng = np.random.default_rng(11)
    # slots of a request: unaligned to the 1 MiB blocks, two of them sharing a block
    layout = [(4096, 3 * COPY_PIECE + 4096), (3 * COPY_PIECE + 12288, 5 * COPY_PIECE), (9 * COPY_PIECE, 777)]
    sources = [rng.integers(0, 256, size, dtype=np.uint8) for _, size in layout]
    pages.write_many(
        [
            (array[offset : offset + size], source, offset)
            for (offset, size), source in zip(layout, sources, strict=True)
        ]
    )
    if pagetables._madvise is not None:
        written = sum(size for _, size in layout)
        assert resident_kib(array.ctypes.data) >= written // 1024
    targets = [np.zeros(size, dtype=np.uint8) for _, size in layout]
    pages.read_many(
        [
            (target, array[offset : offset + size])
            for (offset, size), target in zip(layout, targets, strict=True)
        ]
    )
    for source, target in zip(sources, targets, strict=True):
        assert np.array_equal(source, target)
    with pytest.raises(ValueError, match="cannot copy"):
        pages.read_many([(np.zeros(10, dtype=np.uint8), array[:11])])
    pages.stop()
    assert new_threads("shm-populate") == [] and new_threads("shm-copy") == []
