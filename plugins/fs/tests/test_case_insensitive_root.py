"""A local root on a filesystem that does not tell letter case apart in names (exFAT, FAT,
an ext4 or tmpfs directory with casefolding): keys whose model name or cache_salt differ
only in case share one record file, so a store of one replaces the other's record.  Names
are not changed for it (that would rename every existing cache); the adapter says so at
start-up instead, in one warning line and a flag in its stats (``case_insensitive_root``),
and the replaced key stays a safe miss.

The case-insensitive filesystem is a real one: an exFAT image on a loop device mounted
with exfat-fuse, or a FAT one mounted by the kernel (root, and the tools, needed; the test
is skipped with the reason otherwise)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fs_helpers import fs_config, open_fs

from lmcache_tiers.l2 import L2Adapter
from lmcache_tiers.testing.files import (
    check_case_insensitive_root_told_and_flagged,
    check_case_sensitive_root_not_flagged,
)

SIZE = 8 << 10


def _open(root: str, arena: memoryview) -> L2Adapter:
    return open_fs(fs_config(root, max_capacity_gb=1), arena)


def test_a_case_insensitive_root_is_told_at_start_and_flagged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    check_case_insensitive_root_told_and_flagged(str(tmp_path), _open, caplog, SIZE)


def test_a_case_sensitive_root_is_not_flagged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    check_case_sensitive_root_not_flagged(str(tmp_path / "kv"), _open, caplog)
