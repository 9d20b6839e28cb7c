"""Shared fixtures for the L1 tests: every test must leave /dev/shm as it found it, and
the NVMe L1 tests get a directory on a filesystem with O_DIRECT that must end up empty."""

from __future__ import annotations

import gc
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lmcache_tiers.l1.arena import SEGMENT_PREFIX
from lmcache_tiers.l1.nvme import FILE_SUFFIX

# Helpers shared by the L1 tests (imported by name under importlib mode).
sys.path.insert(0, str(Path(__file__).parent))

# Segments this test process creates: default names carry our pid, and tests that choose a
# name start it with `segment_prefix`. Other processes on the host (parallel test
# runs, a live server) may create segments concurrently, so only ours are checked.
_TEST_PREFIX = f"{SEGMENT_PREFIX}test_{os.getpid()}_"


def _own_segments() -> set[str]:
    mine = (f"{SEGMENT_PREFIX}{os.getpid()}_", _TEST_PREFIX)
    return {path.name for path in Path("/dev/shm").iterdir() if path.name.startswith(mine)}


@pytest.fixture(autouse=True)
def _shm_is_clean_after_test() -> Iterator[None]:
    before = _own_segments()
    yield
    # A full collection costs seconds in a worker whose heap earlier test files grew: it
    # runs only when a segment is still there, to tell garbage not yet collected from a leak.
    if _own_segments() - before:
        gc.collect()
    leaked = _own_segments() - before
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"


@pytest.fixture
def segment_prefix() -> str:
    return _TEST_PREFIX


def _supports_direct_io(directory: Path) -> bool:
    fd, probe = tempfile.mkstemp(dir=directory)
    os.close(fd)
    try:
        fd = os.open(probe, os.O_RDWR | os.O_DIRECT)
    except OSError:
        return False
    finally:
        os.unlink(probe)
    block = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        os.pwrite(fd, block, 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        block.close()


@pytest.fixture
def nvme_dir(tmp_path: Path) -> Iterator[Path]:
    """An empty directory on a filesystem with O_DIRECT; no block file may outlive the test."""
    if not _supports_direct_io(tmp_path):
        pytest.skip(f"{tmp_path} is on a filesystem without O_DIRECT")
    yield tmp_path

    def leaked() -> list[str]:
        return sorted(path.name for path in tmp_path.iterdir() if path.name.endswith(FILE_SUFFIX))

    if leaked():  # garbage not yet collected, or a leak (see _shm_is_clean_after_test)
        gc.collect()
    assert not leaked(), f"NVMe L1 files left behind: {leaked()}"


#: the size of the ext4 image ``loop_ext4`` builds
LOOP_IMAGE_BYTES = 64 << 20


def _run(*command: str) -> str:
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def loop_ext4(tmp_path: Path) -> Iterator[Callable[..., tuple[Path, Path]]]:
    """``loop_ext4(*mkfs_options)`` builds a real filesystem a test may break and answers
    (the mounted ext4 directory, the tmpfs holding its image): ext4 (made with the given mkfs.ext4
    options) on a loop device whose image lives on a tmpfs of twice its size, all undone at
    the end (root, losetup, mkfs.ext4 and mount needed, or the test is skipped)."""
    if os.geteuid() != 0 or not all(shutil.which(tool) for tool in ("losetup", "mkfs.ext4", "mount")):
        pytest.skip("needs root, losetup, mkfs.ext4 and mount to build a filesystem to break")
    undo: list[tuple[str, ...]] = []

    def build(*mkfs_options: str) -> tuple[Path, Path]:
        back, mnt = tmp_path / "back", tmp_path / "mnt"
        back.mkdir()
        mnt.mkdir()
        try:
            _run("mount", "-t", "tmpfs", "-o", f"size={LOOP_IMAGE_BYTES * 2}", "tmpfs", str(back))
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot mount a tmpfs here: {exc.stderr.strip()}")
        undo.append(("umount", str(back)))
        image = back / "disk.img"
        with open(image, "wb") as file:
            file.truncate(LOOP_IMAGE_BYTES)
        loop = _run("losetup", "-f", "--show", str(image))
        undo.append(("losetup", "-d", loop))
        _run("mkfs.ext4", "-q", "-F", *mkfs_options, "-E", "nodiscard,lazy_itable_init=0", loop)
        _run("mount", loop, str(mnt))
        undo.append(("umount", str(mnt)))
        return mnt, back

    try:
        yield build
    finally:
        for command in reversed(undo):
            subprocess.run(command, check=False, capture_output=True)
