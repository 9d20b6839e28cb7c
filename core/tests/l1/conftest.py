"""Shared fixture for the L1 tests: every test must leave /dev/shm as it found it."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_tiers.l1.arena import SEGMENT_PREFIX

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
