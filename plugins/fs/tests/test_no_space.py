"""A full filesystem (a real 1 MiB tmpfs): the records that fit are stored, the rest fail
cleanly, counted and logged once per burst; nothing half-written is visible; stores work
again once space returns."""

from __future__ import annotations

import logging
import os

import pytest
from fs_helpers import Arena, client, fs_config, load, open_fs, record_files, store

from lmcache_tiers.plugin import is_temp_name
from lmcache_tiers.testing.files import small_tmpfs
from lmcache_tiers.testing.l2 import make_keys, pattern

OBJECT = 300 << 10  # three fit in 1 MiB with their 4 KiB headers, the fourth does not


def test_a_batch_that_hits_enospc_stores_what_fits(caplog: pytest.LogCaptureFixture) -> None:
    with small_tmpfs(1 << 20) as root:
        arena = Arena()
        keys = make_keys(6)
        data = [pattern(i, OBJECT) for i in range(5)] + [pattern(5, 1000)]
        adapter = open_fs(fs_config(root), arena.view)
        try:
            with caplog.at_level(logging.WARNING):
                ok = store(adapter, arena, keys, data)
            # The fourth and fifth do not fit; the small sixth does.
            assert ok == [True, True, True, False, False, True]
            stats = adapter.stats()
            assert stats["store_no_space"] == 2
            no_space_lines = [r for r in caplog.records if "no space left" in r.getMessage()]
            assert len(no_space_lines) == 1, "logged once per burst"
            names = [name for _d, _s, files in os.walk(root) for name in files]
            assert not any(is_temp_name(name) for name in names), "no half-written file left"
            assert sorted(record_files(root)) == sorted(
                f"{k.file_stem()}.bin" for k, hit in zip(keys, ok, strict=True) if hit
            )
            result = client(adapter).lookup_and_lock(keys)
            assert result.found == ok
            hits = [k for k, hit in zip(keys, ok, strict=True) if hit]
            loaded, contents = load(
                adapter, arena, hits, [len(d) for d, hit in zip(data, ok, strict=True) if hit]
            )
            assert loaded == [True] * 4 and contents == [d for d, hit in zip(data, ok, strict=True) if hit]
            adapter.unlock(hits)
            # Space returns: the refused objects store now.
            assert adapter.delete(keys[:2]) == [True, True]
            assert store(adapter, arena, keys[3:5], data[3:5]) == [True, True]
        finally:
            adapter.close()
