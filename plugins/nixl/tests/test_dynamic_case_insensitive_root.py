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

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from nixl_helpers import Arena, client, dynamic_config, open_dynamic, scratch_dir

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.testing.files import load_data, store_data
from lmcache_tiers.testing.l2 import pattern
from lmcache_tiers.testing.mounts import CaseInsensitiveMount, case_insensitive_at

SIZE = 64 << 10
FLAG = "case_insensitive_root"


@pytest.fixture
def case_insensitive(tmp_path: Path) -> Iterator[CaseInsensitiveMount]:
    """A freshly made case-insensitive filesystem, unmounted afterwards."""
    with case_insensitive_at(str(tmp_path)) as mounted:
        if isinstance(mounted, str):
            print(mounted)
            pytest.skip(mounted)
        yield mounted


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and "letter case" in r.getMessage()
    ]


def test_a_case_insensitive_directory_is_told_at_start_and_flagged(
    case_insensitive: CaseInsensitiveMount, caplog: pytest.LogCaptureFixture
) -> None:
    root = os.path.join(case_insensitive.path, "kv")
    arena = Arena()
    upper = ObjectKey("Llama", 0, b"\x07" * 32)
    lower = ObjectKey("llama", 0, b"\x07" * 32)
    with caplog.at_level(logging.INFO):
        adapter = open_dynamic(dynamic_config(root), arena.view)
    try:
        (line,) = _warnings(caplog)
        assert root in line and "cache_salt" in line
        assert adapter.stats()[FLAG] == 1
        assert os.listdir(root) == [], "the probe leaves no file"
        # What the line warns of: the second store replaces the first key's record.
        assert store_data(adapter, arena, [upper], [pattern(0, SIZE)]) == [True]
        assert store_data(adapter, arena, [lower], [pattern(1, SIZE)]) == [True]
        assert len(os.listdir(root)) == 1, "both keys' records are one file"
    finally:
        adapter.close()
    case_insensitive.remount()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        adapter = open_dynamic(dynamic_config(root), arena.view)
    try:
        assert len(_warnings(caplog)) == 1, "told at every start"
        assert adapter.stats()[FLAG] == 1
        # After a restart the replaced key is a miss (never the other key's bytes) ...
        assert client(adapter).lookup_and_lock([upper]).found == [False]
        # ... and the key stored last is served.
        assert client(adapter).lookup_and_lock([lower]).found == [True]
        assert load_data(adapter, arena, [lower], [SIZE]) == ([True], [pattern(1, SIZE)])
        adapter.unlock([lower])
    finally:
        adapter.close()


def test_a_case_sensitive_directory_is_not_flagged(caplog: pytest.LogCaptureFixture) -> None:
    arena = Arena()
    with scratch_dir() as root, caplog.at_level(logging.INFO):
        adapter = open_dynamic(dynamic_config(root), arena.view)
        try:
            assert _warnings(caplog) == []
            assert adapter.stats()[FLAG] == 0
            assert os.listdir(root) == [], "the probe leaves no file"
        finally:
            adapter.close()
