"""nixl_store_dynamic on a directory whose filesystem does not tell letter case apart in
names (exFAT, FAT, an ext4 or tmpfs directory with casefolding): its record names are
core's, as fs's are, so keys whose model name or cache_salt differ only in case share one
file and a store of one replaces the other's record.  The adapter says so at start-up, in
one warning line and a flag in its stats (``case_insensitive_root``), and the replaced
key stays a safe miss.

The case-insensitive filesystem is a real one (``lmcache_tiers.testing.mounts``: exFAT
through exfat-fuse on a loop device, else FAT; root and the tools needed, the test is
skipped with the reason otherwise)."""

from __future__ import annotations

from pathlib import Path

import pytest
from nixl_helpers import dynamic_config, open_dynamic, scratch_dir

from lmcache_tiers.l2 import L2Adapter
from lmcache_tiers.testing.files import (
    check_case_insensitive_root_told_and_flagged,
    check_case_sensitive_root_not_flagged,
)

SIZE = 64 << 10


def _open(root: str, arena: memoryview) -> L2Adapter:
    return open_dynamic(dynamic_config(root), arena)


def test_a_case_insensitive_directory_is_told_at_start_and_flagged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    check_case_insensitive_root_told_and_flagged(str(tmp_path), _open, caplog, SIZE)


def test_a_case_sensitive_directory_is_not_flagged(caplog: pytest.LogCaptureFixture) -> None:
    with scratch_dir() as root:
        check_case_sensitive_root_not_flagged(root, _open, caplog)
