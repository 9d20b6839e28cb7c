"""The arena's segment file on a tmpfs of its own: huge pages where the mount offers them
(checked in the server's own smaps), rounding to whole huge pages, a too-small tmpfs as a
one-line error, and directories that cannot hold an arena refused in one line.

Each test mounts a private tmpfs (root works here and in CI) and unmounts it after; where
mounting is refused the test is skipped with the system's reason."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from lmcache_tiers.errors import ConfigError
from lmcache_tiers.l1 import L1Arena
from lmcache_tiers.l1.segment import check_directory, offered_huge
from lmcache_tiers.testing.mounts import tmpfs_at
from lmcache_tiers.tmpfs import huge_page_size, is_tmpfs, mount_of, pmd_mapped_bytes, shmem_override
from lmcache_tiers.wire.shm import MappedSegment, segment_identity

MIB = 1 << 20


@contextlib.contextmanager
def _mounted(tmp_path: Path, options: str) -> Iterator[str]:
    with tmpfs_at(str(tmp_path / "tmpfs"), options) as refused:
        if refused is not None:
            pytest.skip(refused)
        yield str(tmp_path / "tmpfs")


@contextlib.contextmanager
def _huge(tmp_path: Path, mode: str) -> Iterator[str]:
    if shmem_override() == "deny":
        pytest.skip("shmem_enabled=deny: this system gives no tmpfs huge pages")
    with _mounted(tmp_path, f"size=64m,huge={mode}") as directory:
        yield directory


@pytest.fixture
def huge_dir(tmp_path: Path) -> Iterator[str]:
    with _huge(tmp_path, "always") as directory:
        yield directory


@pytest.fixture
def advise_dir(tmp_path: Path) -> Iterator[str]:
    with _huge(tmp_path, "advise") as directory:
        yield directory


def _address(arena: L1Arena) -> int:
    anchor = ctypes.c_char.from_buffer(arena.buffer)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor


def test_an_arena_on_a_huge_tmpfs_is_on_huge_pages_and_says_so(huge_dir: str) -> None:
    size = 5 * MIB + 4096  # not a whole number of huge pages
    with L1Arena(size, directory=huge_dir, generation_block=4096) as arena:
        assert arena.path == os.path.join(huge_dir, arena.name)
        pages = arena.pages
        assert pages is not None and pages.offered == "always"
        assert pages.huge and pages.hint() is None and "huge pages" in pages.describe()
        # rounded up to whole huge pages, generation table included
        assert arena.segment_size % huge_page_size() == 0
        assert arena.segment_size >= size + 8 * (size // 4096)
        assert os.stat(arena.path).st_size == arena.segment_size
        assert pmd_mapped_bytes(_address(arena), arena.segment_size) == arena.segment_size
        arena.buffer[size - 1] = 7
        assert arena.buffer[size - 1] == 7
        assert pages.status()["huge_pages"] is True
    assert not os.listdir(huge_dir)


def test_an_advise_mount_gets_huge_pages_through_madvise(advise_dir: str) -> None:
    assert offered_huge(advise_dir) == "advise"
    with L1Arena(4 * MIB, directory=advise_dir) as arena:
        assert arena.pages is not None and arena.pages.huge
        # reserved whole, not only faulted in
        assert os.stat(arena.path).st_blocks * 512 >= 4 * MIB


def test_a_within_size_mount_gets_huge_pages_for_the_rounded_file(tmp_path: Path) -> None:
    with _huge(tmp_path, "within_size") as directory, L1Arena(3 * MIB, directory=directory) as arena:
        assert arena.segment_size == 4 * MIB
        assert arena.pages is not None and arena.pages.huge and arena.pages.offered == "within_size"


def test_dev_shm_without_huge_pages_says_how_to_get_them() -> None:
    if offered_huge("/dev/shm") != "never":
        pytest.skip(f"/dev/shm offers huge pages here ({offered_huge('/dev/shm')})")
    with L1Arena(4 * MIB) as arena:
        pages = arena.pages
        assert pages is not None and not pages.huge
        assert arena.segment_size == 4 * MIB  # no rounding without huge pages
        hint = pages.hint()
        assert hint is not None and "huge=always" in hint and "--shm-dir" in hint
        assert pages.status() == {
            "directory": "/dev/shm",
            "huge_pages": False,
            "tmpfs_huge": "never",
            "huge_page_mapped_bytes": 0,
            "hint": hint,
        }


def test_no_prefault_means_not_checked(huge_dir: str) -> None:
    with L1Arena(2 * MIB, directory=huge_dir, prefault=False) as arena:
        assert arena.pages is not None
        assert arena.pages.huge_bytes is None and not arena.pages.huge
        assert "not checked" in (arena.pages.hint() or "")


@pytest.mark.parametrize("huge", ["always", "advise"])
def test_a_too_small_huge_tmpfs_is_a_one_line_error_not_a_sigbus(tmp_path: Path, huge: str) -> None:
    with _mounted(tmp_path, f"size=8m,huge={huge}") as directory:
        with pytest.raises(ConfigError, match="lower --l1-size-gb or enlarge") as caught:
            L1Arena(16 * MIB, directory=directory, name="too_big")
        assert "\n" not in str(caught.value) and directory in str(caught.value)
        assert not os.listdir(directory)


def test_directories_that_cannot_hold_an_arena_are_refused(tmp_path: Path) -> None:
    on_disk = tmp_path / "disk"
    on_disk.mkdir()
    a_file = tmp_path / "file"
    a_file.write_bytes(b"x")
    if is_tmpfs(str(on_disk)):
        pytest.skip("the test directory is itself on a tmpfs")
    cases = [
        (str(tmp_path / "missing"), "does not exist"),
        (str(a_file), "is a file, not a directory"),
        (str(on_disk), "not on a tmpfs"),
        ("relative/dir", "absolute path"),
    ]
    for directory, words in cases:
        with pytest.raises(ConfigError, match=words):
            check_directory(directory)
    with _mounted(tmp_path, "size=4m,ro") as directory, pytest.raises(ConfigError, match="not writable"):
        check_directory(directory)


def test_mount_lookup_and_smaps_on_this_machine(huge_dir: str) -> None:
    mount = mount_of(os.path.join(huge_dir, "below", "a-file"))
    assert mount is not None and mount.point == huge_dir
    assert mount.fstype == "tmpfs" and mount.huge == "always"
    dev_shm = mount_of("/dev/shm")
    assert dev_shm is not None and dev_shm.fstype == "tmpfs"
    anonymous = mmap.mmap(-1, MIB)
    try:
        anchor = ctypes.c_char.from_buffer(anonymous)
        address = ctypes.addressof(anchor)
        del anchor
        assert pmd_mapped_bytes(address, MIB) == 0
    finally:
        anonymous.close()
    assert pmd_mapped_bytes(0, MIB, smaps="/proc/no-such-process/smaps") is None


def test_a_clients_background_population_maps_huge_pages(huge_dir: str) -> None:
    with L1Arena(8 * MIB, directory=huge_dir) as arena:
        device, inode = segment_identity(arena.name, huge_dir)
        segment = MappedSegment(arena.name, arena.segment_size, device, inode, directory=huge_dir)
        try:
            assert segment.pages.wait(30)
            address = segment.array.ctypes.data
            assert address % huge_page_size() == 0
            assert pmd_mapped_bytes(address, segment.size) == segment.size
            # a split copy over the populated huge pages still moves exact bytes
            payload = np.random.default_rng(3).integers(0, 256, 6 * MIB, dtype=np.uint8)
            segment.write(MIB, payload)
            assert bytes(arena.buffer[MIB : 7 * MIB]) == payload.tobytes()
            back = np.zeros(6 * MIB, dtype=np.uint8)
            segment.read_into(MIB, 6 * MIB, back)
            assert np.array_equal(back, payload)
        finally:
            segment.close()
