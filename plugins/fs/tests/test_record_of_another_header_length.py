"""A record replaced between a lookup and its load by an intact record of the same key and
payload whose header has another length (another writer's, such as one that does not pad
its header to the block) is a miss that is kept -- not damage -- on an fsspec store as on
a local directory: counted (``load_size_changed``) and explained in a log line naming both
lengths.  Removed as damage, another writer's acknowledged object would be lost."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import fsspec
import pytest
from fs_helpers import HEADER, Arena, client, fs_config, load, open_fs, store

from lmcache_tiers.l2.record import encode_header
from lmcache_tiers.testing.l2 import make_keys, pattern

SIZE = 8 << 10


@pytest.mark.parametrize("where", ["local", "local-direct", "memory"])
def test_a_record_of_another_header_length_is_a_counted_kept_miss(
    tmp_path: Path, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    if where == "memory":
        fs = fsspec.filesystem("memory")
        root = f"memory://header-length-{uuid.uuid4().hex}"
        top = root.removeprefix("memory://")
    else:
        fs = fsspec.filesystem("file")
        root = top = str(tmp_path / "kv")
    fields = {"use_odirect": True} if where == "local-direct" else {}
    arena = Arena()
    key = make_keys(1)
    adapter = open_fs(fs_config(root, max_capacity_gb=1, **fields), arena.view)
    try:
        assert store(adapter, arena, key, [pattern(0, SIZE)]) == [True]
        result = client(adapter).lookup_and_lock(key)
        assert result.found == [True] and result.sizes == [SIZE]
        data = pattern(1, SIZE)
        unpadded = encode_header(key[0], data)  # the same payload length, a shorter header
        assert len(unpadded) != HEADER
        path = f"{top}/{key[0].file_stem()}.bin"
        fs.pipe_file(path, unpadded + bytes(data))
        with caplog.at_level(logging.INFO):
            assert load(adapter, arena, key, [SIZE])[0] == [False]
        adapter.unlock(key)
        stats = adapter.stats()
        assert stats.get("load_size_changed") == 1
        assert stats.get("corrupt_records_removed", 0) == 0
        lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        explained = [line for line in lines if key[0].file_stem() in line and "a miss, kept" in line]
        assert explained, lines
        assert f"header {len(unpadded)}, payload {SIZE}" in explained[0], explained[0]
        assert fs.cat_file(path) == unpadded + bytes(data), "another intact record is kept"
    finally:
        adapter.close()
        if where == "memory":
            fs.rm(top, recursive=True)
