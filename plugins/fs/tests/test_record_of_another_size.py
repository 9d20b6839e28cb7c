"""A record replaced between a lookup and its load by an intact record of the same key but
another size (another writer on the directory, with another chunk size) is a miss that is
kept -- not damage -- and, as the other adapters count the same case, counted
(``load_size_changed``) and explained in a log line."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import fsspec
import pytest
from fs_helpers import Arena, client, fs_config, load, open_fs, store

from lmcache_tiers.testing.l2 import make_keys, pattern

SIZE = 8 << 10
OTHER_SIZE = 5 << 10


@pytest.mark.parametrize("where", ["local", "local-direct", "memory"])
def test_a_record_replaced_by_one_of_another_size_is_a_counted_kept_miss(
    tmp_path: Path, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    if where == "memory":
        fs = fsspec.filesystem("memory")
        root, other_root = (f"memory://other-size-{uuid.uuid4().hex}" for _ in range(2))
        top, other_top = (r.removeprefix("memory://") for r in (root, other_root))
    else:
        fs = fsspec.filesystem("file")
        root = top = str(tmp_path / "kv")
        other_root = other_top = str(tmp_path / "other")
    fields = {"use_odirect": True} if where == "local-direct" else {}
    arena = Arena()
    key = make_keys(1)
    adapter = open_fs(fs_config(root, max_capacity_gb=1, **fields), arena.view)
    other = open_fs(fs_config(other_root, max_capacity_gb=1), arena.view)
    try:
        assert store(adapter, arena, key, [pattern(0, SIZE)]) == [True]
        assert store(other, arena, key, [pattern(1, OTHER_SIZE)]) == [True]
        result = client(adapter).lookup_and_lock(key)
        assert result.found == [True] and result.sizes == [SIZE]
        name = f"{key[0].file_stem()}.bin"
        replacement = fs.cat_file(f"{other_top}/{name}")  # the other writer's record
        fs.pipe_file(f"{top}/{name}", replacement)
        with caplog.at_level(logging.INFO):
            assert load(adapter, arena, key, [SIZE])[0] == [False]
        adapter.unlock(key)
        stats = adapter.stats()
        assert stats.get("load_size_changed") == 1
        assert stats.get("corrupt_records_removed", 0) == 0
        assert stats.get("load_read_errors", 0) == 0
        lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert [line for line in lines if key[0].file_stem() in line and "a miss" in line], lines
        assert fs.cat_file(f"{top}/{name}") == replacement, "another intact record is kept"
    finally:
        adapter.close()
        other.close()
        if where == "memory":
            for path in (top, other_top):
                fs.rm(path, recursive=True)
