"""fs on an fsspec URL whose root is the filesystem's own ``/`` (``dir://`` over a
directory, ``memory://``, an FTP server's top): the records of the flat layout sit
directly in ``/``, and a restart must find them where the layout puts them."""

from __future__ import annotations

from pathlib import Path

import pytest
from fs_helpers import Arena, client, fs_config, load, open_fs, store

from lmcache_tiers.testing.l2 import make_keys, pattern

SIZE = 8 << 10


@pytest.mark.parametrize("shard_dirs", [False, True])
def test_records_at_the_top_of_an_fsspec_root_are_found_after_a_restart(
    tmp_path: Path, shard_dirs: bool
) -> None:
    config = fs_config(
        "dir:///",
        storage_options={"path": str(tmp_path), "target_protocol": "file"},
        shard_dirs=shard_dirs,
        max_capacity_gb=1,
    )
    arena = Arena()
    keys = make_keys(3)
    data = [pattern(i, SIZE) for i in range(3)]
    adapter = open_fs(config, arena.view)
    try:
        assert store(adapter, arena, keys, data) == [True] * 3
    finally:
        adapter.close()
    again = open_fs(config, arena.view)
    try:
        stats = again.stats()
        assert stats.get("records_misplaced", 0) == 0, "the records are where the layout puts them"
        assert stats.get("scan_keys") == 3
        assert again.used_bytes() == 3 * SIZE
        result = client(again).lookup_and_lock(keys)
        assert result.found == [True] * 3
        assert load(again, arena, keys, result.sizes) == ([True] * 3, data)
        again.unlock(keys)
    finally:
        again.close()
