"""Shared fixtures for the L1 tests: every test must leave /dev/shm as it found it, and
the NVMe L1 tests get a directory on a filesystem with O_DIRECT that must end up empty."""

from __future__ import annotations

import gc
import mmap
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_tiers.l1.arena import SEGMENT_PREFIX
from lmcache_tiers.l1.nvme import FILE_SUFFIX

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
    gc.collect()
    leaked = sorted(path.name for path in tmp_path.iterdir() if path.name.endswith(FILE_SUFFIX))
    assert not leaked, f"NVMe L1 files left behind: {leaked}"
